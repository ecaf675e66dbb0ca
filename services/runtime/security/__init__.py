"""Who may call a server and how: TLS and mTLS, the internal token, the public guard."""
