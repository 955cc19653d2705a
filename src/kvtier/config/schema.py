"""The table of config keys: name, parser, default, and the line the README shows.

Names follow LMCache where it has the key (``lmcache=True``: its YAML and ``LMCACHE_<KEY>``
environment variables are read unchanged); kvtier's own keys have ``lmcache=False``.
Adding a key means one row here and one field on :class:`kvtier.config.Config`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.config import parsers as p
from kvtier.config.channels import TRANSFER_CHANNELS
from kvtier.config.sizes import GIB
from kvtier.config.tenant_quotas import parse_tenant_quotas

HASH_ALGORITHMS = ("xxh3_128", "blake3", "sha256")
CACHE_POLICIES = ("LRU", "REUSE")  # the names kvtier.storage.policy.POLICIES implements
# The names of kvtier.storage.codecs.BUILTIN (a test keeps them equal; config sits below
# storage and cannot import the registry).
PAYLOAD_CODECS = ("identity", "lossless", "fp8", "int8")


@dataclass(frozen=True, slots=True)
class KeySpec:
    name: str
    parse: p.Parser
    default: object
    doc: str
    lmcache: bool = True
    secret: bool = False
    verbatim: bool = False  # an environment value is this text as written (not YAML)

    def __post_init__(self) -> None:
        # Every secret's parser is wrapped here, by the flag, rather than row by row: a row
        # that forgot the wrapper printed its value whole in an error whenever YAML read it
        # as something other than text (an all-digit pd_auth_token is an int).
        if self.secret:
            object.__setattr__(self, "parse", p.secret(self.parse))


KEYS: tuple[KeySpec, ...] = (
    KeySpec(
        "chunk_size",
        p.integer(1, 1 << 20),
        256,
        "Tokens per KV chunk (the unit of caching). Unset under vLLM: the smallest multiple "
        "of vLLM's block size that is at least 128 (a model with Mamba/GDN states: vLLM's "
        "step budget; a sliding-window model: 4x the tokens its window keeps, with each "
        "prompt's checkpoint at its last whole block).",
    ),
    KeySpec("local_cpu", p.boolean, True, "CPU memory is a cache tier (see the tier-role table)."),
    KeySpec(
        "max_local_cpu_size",
        p.size(GIB),
        5.0,
        "CPU buffer ceiling; GB number or '512MiB'; rounded down to whole chunks.",
    ),
    KeySpec("local_disk", p.text(), None, "Disk tier directory, a path or file:// URL."),
    KeySpec(
        "max_local_disk_size",
        p.size(GIB),
        0.0,
        "Disk capacity of the whole directory (every model's files); GB number or '20GiB'.",
    ),
    KeySpec(
        "remote_url",
        p.remote_url,
        None,
        "redis://, rediss://, unix://, redis-cluster://, valkey:// or resp:// URL of a shared "
        "store, or s3://bucket/prefix for an object store (docs/s3.md; or a scheme registered "
        "in kvtier.storage.registry).",
    ),
    KeySpec(
        "cpu_codec",
        p.choice(PAYLOAD_CODECS, fold_case=False),
        "identity",
        "CPU tier payload codec: identity (zero copy), lossless, fp8 or int8 (more chunks "
        "in the same RAM, decoded at load; see docs/codecs.md).",
        lmcache=False,
    ),
    KeySpec(
        "cpu_codec_staging",
        p.size(GIB),
        0.0,
        "With a cpu_codec: the part of max_local_cpu_size kept as decoded staging pages for "
        "loads and stores in flight; 0 = 1/16 of it.",
        lmcache=False,
    ),
    KeySpec(
        "disk_codec",
        p.choice(PAYLOAD_CODECS, fold_case=False),
        "identity",
        "Disk tier payload codec: identity, lossless (shuffle+zstd), fp8 or int8 (lossy: "
        "another cache, see docs/codecs.md).",
        lmcache=False,
    ),
    KeySpec(
        "remote_codec",
        p.choice(PAYLOAD_CODECS, fold_case=False),
        "identity",
        "Remote tier payload codec: identity, lossless, fp8 or int8 (LMCache's remote_serde "
        "fp8 sets fp8).",
        lmcache=False,
    ),
    KeySpec("save_unfull_chunk", p.boolean, False, "Also store the last partial chunk."),
    KeySpec(
        "save_decode_cache",
        p.boolean,
        True,
        "vLLM: when a request ends, also store the whole chunks of its generated tokens (a "
        "chat's next turn sends the answer back in its prompt; LMCache's default is false).",
    ),
    KeySpec(
        "pre_caching_hash_algorithm",
        p.choice(HASH_ALGORITHMS),
        "xxh3_128",
        "Chunk-key hash: xxh3_128, blake3 or sha256 (never Python's salted hash()).",
    ),
    KeySpec(
        "cache_policy",
        p.choice(CACHE_POLICIES),
        "REUSE",
        "CPU and disk tier eviction: REUSE (reused chunks outlive new ones, leaf-first) or LRU.",
    ),
    KeySpec(
        "tenant_quotas",
        parse_tenant_quotas,
        None,
        "Per-tenant (cache_salt) limit in each CPU and disk tier and the PD receive buffer, "
        "a cap in a Redis or S3 store: {salt: '2GiB', '*': '25%'} ('*': unnamed tenants; "
        "'': no salt); set at run time with PUT /quota (docs/tenants.md).",
        lmcache=False,
    ),
    KeySpec(
        "use_only_staging_buffer",
        p.boolean,
        False,
        "With local_cpu false: CPU only stages writes, freed once the lower tier has them.",
    ),
    KeySpec("enable_pd", p.boolean, False, "Prefill/decode disaggregation on."),
    KeySpec(
        "pd_role", p.choice(("sender", "receiver"), optional=True), None, "sender or receiver."
    ),
    KeySpec(
        "pd_buffer_size",
        p.size(1, optional=True),
        None,
        "Receiver buffer ceiling in bytes or '1GiB'; rounded down to whole chunks.",
    ),
    KeySpec(
        "pd_buffer_device",
        p.choice(("cpu", "cuda"), optional=True),
        None,
        "cpu; cuda (as LMCache's PD configs say) is accepted as host memory too: a "
        "host-to-device copy at load.",
    ),
    KeySpec("pd_peer_host", p.text(), None, "Receiver host the sender connects to."),
    KeySpec("pd_peer_alloc_port", p.ports, None, "Receiver allocation port (or one per rank)."),
    KeySpec(
        "pd_serve_host",
        p.text(),
        "127.0.0.1",
        "A PD sender with no pd_peer_alloc_port: where decoders pull from (listens, and is "
        "named in kv_transfer_params).",
        lmcache=False,
    ),
    KeySpec(
        "pd_serve_port",
        p.ports,
        None,
        "That sender's port (or one per TP rank); unset: a free port, named per request.",
        lmcache=False,
    ),
    KeySpec(
        "pd_allocation_timeout_sec",
        p.positive_float(3600.0),
        10.0,
        "How long a sender waits for room in the receiver's buffer before failing the request.",
    ),
    KeySpec(
        "pd_auth_token",
        p.text(),
        None,
        "Shared secret of a PD sender and receiver (16+ characters); required beyond loopback.",
        lmcache=False,
        secret=True,
    ),
    KeySpec(
        "pd_reservation_ttl_sec",
        p.positive_float(86400.0),
        120.0,
        "A PD reservation the decoder has not looked up within this many seconds is freed.",
        lmcache=False,
    ),
    KeySpec(
        "pd_max_connections",
        p.integer(1, 4096),
        64,
        "Most sender connections a PD receiver serves at once; more are closed at accept.",
        lmcache=False,
    ),
    KeySpec(
        "pd_idle_timeout_sec",
        p.positive_float(86400.0),
        300.0,
        "A PD sender connection idle between requests this long is closed (senders reconnect).",
        lmcache=False,
    ),
    KeySpec(
        "pd_message_timeout_sec",
        p.positive_float(3600.0),
        30.0,
        "Longest a PD peer may take over one message, a chunk's payload included.",
        lmcache=False,
    ),
    KeySpec(
        "transfer_channel",
        p.choice(TRANSFER_CHANNELS, optional=True),
        None,
        "PD transport: tcp, shm (same host) or nixl.",
    ),
    KeySpec(
        "use_layerwise",
        p.boolean,
        False,
        "vLLM: load each attention layer's KV just before that layer computes (one copy and "
        "fence per layer, overlapped with the layers before it); vLLM then runs piecewise "
        "CUDA graphs. Off: whole chunks load before the forward (docs/vllm.md).",
    ),
    KeySpec(
        "blocking_timeout_secs",
        p.positive_float(3600.0),
        10.0,
        "Longest a tier call may block (a socket, a disk read, a wait for a free Redis "
        "connection) before it counts as a miss.",
    ),
    KeySpec(
        "internal_api_server_enabled", p.boolean, False, "Serve the HTTP admin API and dashboard."
    ),
    KeySpec("internal_api_server_host", p.text(optional=False), "127.0.0.1", "Admin API host."),
    KeySpec("internal_api_server_port_start", p.integer(0, 65535), 6999, "Admin API port."),
    KeySpec(
        "admin_token",
        p.text(),
        None,
        "Bearer token required by every admin endpoint but /health.",
        lmcache=False,
        secret=True,
    ),
    KeySpec(
        "cache_salt",
        p.text(optional=False, max_len=128),
        "",
        "Tenant salt: caches with different salts never share a chunk.",
        lmcache=False,
    ),
    KeySpec(
        "server_socket",
        p.text(),
        None,
        "kvtier server's Unix socket (path or unix:// URL); default "
        "$XDG_RUNTIME_DIR/kvtier.sock, else $TMPDIR/kvtier-<uid>/kvtier.sock (a 0700 "
        "directory; when another user made it first, kvtier's own "
        "$TMPDIR/kvtier-<uid>.XXXXXXXX beside it, where clients look too).",
        lmcache=False,
        verbatim=True,
    ),
    KeySpec(
        "server_max_clients",
        p.integer(1, 4096),
        64,
        "kvtier server: connections served at once; more are refused with a clear error.",
        lmcache=False,
    ),
    KeySpec(
        "server_salt_quota",
        p.size(1, optional=True),
        None,
        "kvtier server: CPU bytes the models of one engine-wide cache_salt may hold together; "
        "none: no quota.",
        lmcache=False,
    ),
    KeySpec(
        "server_max_memory",
        p.size(1, optional=True),
        None,
        "kvtier server: CPU bytes all models together may hold; a model that does not fit "
        "(after idle ones are released) is refused. none: the machine's memory.",
        lmcache=False,
    ),
    KeySpec(
        "server_model_idle_secs",
        p.positive_float(86400.0),
        300.0,
        "kvtier server: a model with no client for this long is released (its CPU tier; "
        "its disk tier stays).",
        lmcache=False,
    ),
    KeySpec(
        "server_client_pin_share",
        p.positive_float(1.0),
        0.5,
        "kvtier server: the share of a model's pages one connection may hold pinned; a "
        "lookup, retrieve or store past it gets a shorter hit or fewer pages (none at it).",
        lmcache=False,
    ),
    KeySpec(
        "server_client_max_requests",
        p.integer(1, 1 << 20),
        4096,
        "kvtier server: requests one connection may hold open (looked up, not ended); a "
        "lookup past it is refused with an error naming this key.",
        lmcache=False,
    ),
    KeySpec(
        "server_client_max_tokens",
        p.integer(1, 1 << 31),
        1 << 23,
        "kvtier server: tokens one connection's open requests may keep the keys of, all "
        "together; a lookup past it is refused with an error naming this key.",
        lmcache=False,
    ),
    KeySpec(
        "p2p_listen",
        p.text(),
        None,
        "kvtier server: host:port of its P2P port (announces its CPU chunks, serves pulls; "
        "port 0: a free one); unset: no peer-to-peer sharing (docs/fleet.md).",
        lmcache=False,
    ),
    KeySpec(
        "p2p_peers",
        p.addresses,
        None,
        "kvtier server: the fleet's P2P addresses (host:port list; its own is skipped): a "
        "local miss that one of them announced is pulled from it.",
        lmcache=False,
    ),
    KeySpec(
        "p2p_auth_token",
        p.text(),
        None,
        "Shared secret of a fleet's P2P peers (16+ characters); required with p2p_listen.",
        lmcache=False,
        secret=True,
    ),
    KeySpec(
        "p2p_lease_secs",
        p.positive_float(3600.0),
        3.0,
        "A P2P peer silent this long (heartbeats every third of it) is dropped from the "
        "directory: its chunks are misses until it is back.",
        lmcache=False,
    ),
    KeySpec("extra_config", p.mapping, None, "Free-form mapping of tier options (see README)."),
)

KEYS_BY_NAME = {spec.name: spec for spec in KEYS}

# LMCache keys kvtier reads under another name, ignores or refuses: kvtier.config.lmcache.
