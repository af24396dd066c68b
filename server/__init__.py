"""kiln's "talk" box: the OpenAI-compatible HTTP server, the `kiln` command line and the benchmarks."""
