#!/bin/sh
echo "coverage is not supported offline (stub remote_coverage_tools)" >&2
exit 1
