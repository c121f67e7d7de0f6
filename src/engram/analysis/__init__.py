"""Analysis tools: evidence experiments, gate visualisation, table statistics."""
