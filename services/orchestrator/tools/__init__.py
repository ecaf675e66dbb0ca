"""Tool calling: Gemma-4's call syntax read and written, tool_choice, the grammar a forced call follows."""
