"""The host's Python 3.11, which every Python environment of the build is made from (repository rules only)."""

def find_host_python(rctx):
    """`SHARDWISE_PYTHON` if set, else python3.11 or python3 on the PATH."""
    override = rctx.os.environ.get("SHARDWISE_PYTHON")
    if override:
        return override
    for name in ["python3.11", "python3"]:
        found = rctx.which(name)
        if found:
            return str(found)
    fail("No python3 found on PATH to create the environment from; set SHARDWISE_PYTHON=/path/to/python3.11")
