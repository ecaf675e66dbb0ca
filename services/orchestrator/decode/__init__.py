"""The decode core: the engine, its scheduler, the accept/trim loop, block sizing, round costs, the request check."""
