"""kiln's "talk" box: the OpenAI-compatible HTTP server and the `kiln` command line."""
