"""The session's SeaweedFS and a bucket per test (tests/s3_servers.py) for the s3 tier tests."""

from tests.s3_servers import bucket, seaweedfs  # noqa: F401 (fixtures)
