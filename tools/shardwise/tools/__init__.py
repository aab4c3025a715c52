"""Developer tools for shardwise: Bazel helpers, benchmarks, the demo trainer."""
