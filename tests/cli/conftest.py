"""Fixtures of tests/cli: a real S3 server (SeaweedFS) for check-config's probes."""

from tests.s3_servers import bucket, seaweedfs  # noqa: F401 (fixtures)
