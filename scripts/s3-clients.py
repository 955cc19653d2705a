"""Which S3 client the s3 tier uses, by measurement: put/get GB/s of KV-chunk-sized objects.

    .venv/bin/pip install awscrt boto3 obstore   # the candidates (only the winner is a dependency)
    .venv/bin/python scripts/s3-clients.py [--sizes 1,4,8] [--objects 24] [--threads 1,4] [--json]

Starts a SeaweedFS (kvtier.bench.seaweedfs) unless AWS_ENDPOINT_URL and credentials are set
in the environment (then it uses that server and a bucket it creates). Every client moves
the same objects (random bytes, ``--objects`` of each size) with ``--threads`` requests in
flight: a put sends bytes from a buffer the caller owns, a get lands the whole object in a
buffer (``bytes`` or the client's own buffer; a client that can write into a caller's
buffer does). Every get is checked byte for byte against what was put. Each figure is the
best of ``--repeats`` rounds, clients taking turns within each round.

Clients:
  obstore   Rust (object_store + reqwest); get returns a Rust-owned buffer (no copy)
  awscrt    the AWS Common Runtime S3 client (LMCache's choice): C event loop, callbacks
  boto3     botocore over urllib3 (flexible checksums left at their default)
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from kvtier.bench.seaweedfs import SeaweedFS

Putter = Callable[[str, memoryview], None]
Getter = Callable[[str], memoryview]


def obstore_client(endpoint: str, bucket: str, creds: dict[str, str]) -> tuple[Putter, Getter]:
    import obstore
    from obstore.store import S3Store

    store = S3Store(
        bucket,
        endpoint=endpoint,
        access_key_id=creds["access_key_id"],
        secret_access_key=creds["secret_access_key"],
        region=creds["region"],
        virtual_hosted_style_request=False,
        client_options={"allow_http": True},
    )

    def put(key: str, data: memoryview) -> None:
        obstore.put(store, key, data, use_multipart=False)

    def get(key: str) -> memoryview:
        return memoryview(obstore.get(store, key).bytes())

    return put, get


def awscrt_client(endpoint: str, bucket: str, creds: dict[str, str]) -> tuple[Putter, Getter]:
    from awscrt.auth import AwsCredentialsProvider
    from awscrt.http import HttpHeaders, HttpRequest
    from awscrt.io import ClientBootstrap, DefaultHostResolver, EventLoopGroup
    from awscrt.s3 import S3Client, S3RequestTlsMode, S3RequestType

    host = endpoint.split("://", 1)[1]
    loops = EventLoopGroup()
    bootstrap = ClientBootstrap(loops, DefaultHostResolver(loops))
    provider = AwsCredentialsProvider.new_static(creds["access_key_id"], creds["secret_access_key"])
    client = S3Client(
        bootstrap=bootstrap,
        region=creds["region"],
        credential_provider=provider,
        tls_mode=S3RequestTlsMode.DISABLED,
        part_size=16 << 20,  # one request per object: chunks are at most 8 MB
        multipart_upload_threshold=64 << 20,
        throughput_target_gbps=10.0,
    )

    def put(key: str, data: memoryview) -> None:
        headers = HttpHeaders([("Host", host), ("Content-Length", str(data.nbytes))])
        request = HttpRequest("PUT", f"/{bucket}/{key}", headers, io.BytesIO(data))
        done = client.make_request(type=S3RequestType.PUT_OBJECT, request=request)
        done.finished_future.result(60)

    def get(key: str) -> memoryview:
        headers = HttpHeaders([("Host", host)])
        request = HttpRequest("GET", f"/{bucket}/{key}", headers)
        parts: list[tuple[int, bytes]] = []
        sizes: dict[str, int] = {}

        def on_headers(status_code: int, headers: list[tuple[str, str]], **_: object) -> None:
            for name, value in headers:
                if name.lower() == "content-length":
                    sizes["n"] = int(value)

        def on_body(chunk: bytes, offset: int, **_: object) -> None:
            parts.append((offset, chunk))

        done = client.make_request(
            type=S3RequestType.GET_OBJECT, request=request, on_headers=on_headers, on_body=on_body
        )
        done.finished_future.result(60)
        out = bytearray(sizes.get("n", sum(len(c) for _, c in parts)))
        for offset, chunk in parts:
            out[offset : offset + len(chunk)] = chunk
        return memoryview(out)

    return put, get


def boto3_client(endpoint: str, bucket: str, creds: dict[str, str]) -> tuple[Putter, Getter]:
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=creds["access_key_id"],
        aws_secret_access_key=creds["secret_access_key"],
        region_name=creds["region"],
        config=Config(max_pool_connections=32, s3={"addressing_style": "path"}),
    )

    def put(key: str, data: memoryview) -> None:
        client.put_object(Bucket=bucket, Key=key, Body=bytes(data))

    def get(key: str) -> memoryview:
        return memoryview(client.get_object(Bucket=bucket, Key=key)["Body"].read())

    return put, get


CLIENTS = {"obstore": obstore_client, "awscrt": awscrt_client, "boto3": boto3_client}


def run_round(
    put: Putter, get: Getter, objects: list[bytes], prefix: str, threads: int
) -> tuple[float, float]:
    keys = [f"{prefix}/{i}" for i in range(len(objects))]
    total = sum(len(o) for o in objects)
    with ThreadPoolExecutor(threads) as pool:
        start = time.perf_counter()
        list(pool.map(lambda i: put(keys[i], memoryview(objects[i])), range(len(keys))))
        put_s = time.perf_counter() - start
        start = time.perf_counter()
        got = list(pool.map(get, keys))
        get_s = time.perf_counter() - start
    for i, data in enumerate(got):
        if data != objects[i]:
            raise AssertionError(f"{prefix}/{i}: the bytes read back differ from those put")
    return total / put_s / 1e9, total / get_s / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default=",".join(CLIENTS))
    parser.add_argument("--sizes", default="1,4,8", help="object sizes in MB")
    parser.add_argument("--objects", type=int, default=24, help="objects of each size per round")
    parser.add_argument("--threads", default="1,4", help="requests in flight")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    server = None
    if os.environ.get("AWS_ENDPOINT_URL") and os.environ.get("AWS_ACCESS_KEY_ID"):
        endpoint = os.environ["AWS_ENDPOINT_URL"]
        creds = {
            "access_key_id": os.environ["AWS_ACCESS_KEY_ID"],
            "secret_access_key": os.environ.get("AWS_SECRET_ACCESS_KEY", ""),
            "region": os.environ.get("AWS_REGION", "us-east-1"),
        }
        from kvtier.storage.s3.client import create_bucket

        bucket = "kvtier-clients"
        create_bucket(endpoint, bucket, creds, timeout_s=10.0)
    else:
        server = SeaweedFS().start()
        endpoint, creds, bucket = server.endpoint, server.credentials_dict(), "kvtier-clients"
        server.create_bucket(bucket)
    try:
        clients = {name: CLIENTS[name](endpoint, bucket, creds) for name in args.clients.split(",")}
        rows = []
        for size_mb in (int(s) for s in args.sizes.split(",")):
            objects = [os.urandom(size_mb << 20) for _ in range(args.objects)]
            for threads in (int(t) for t in args.threads.split(",")):
                best: dict[str, list[float]] = {name: [0.0, 0.0] for name in clients}
                for repeat in range(args.repeats):
                    for name, (put, get) in clients.items():
                        prefix = f"{name}/{size_mb}/{threads}/{repeat}"
                        put_gbps, get_gbps = run_round(put, get, objects, prefix, threads)
                        best[name][0] = max(best[name][0], put_gbps)
                        best[name][1] = max(best[name][1], get_gbps)
                for name, (put_gbps, get_gbps) in best.items():
                    row = {
                        "client": name,
                        "size_mb": size_mb,
                        "threads": threads,
                        "put_gbps": round(put_gbps, 3),
                        "get_gbps": round(get_gbps, 3),
                    }
                    rows.append(row)
                    if not args.json:
                        print(
                            f"{name:8} {size_mb} MB x{threads}: put {put_gbps:.3f} GB/s"
                            f"  get {get_gbps:.3f} GB/s",
                            flush=True,
                        )
        if args.json:
            json.dump({"endpoint": endpoint, "results": rows}, sys.stdout, indent=1)
            print()
    finally:
        if server is not None:
            server.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
