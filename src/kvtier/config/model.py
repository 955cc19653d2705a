"""The :class:`Config` dataclass and its loader."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from kvtier.config import lmcache
from kvtier.config.channels import check_channel
from kvtier.config.schema import KEYS, KEYS_BY_NAME
from kvtier.config.tenant_quotas import TenantLimit
from kvtier.config.unknown_keys import check_unknown, unknown_key_errors
from kvtier.errors import ConfigError

log = logging.getLogger(__name__)

# KVTIER_* variables that are not config keys (the CLI's, the test suite's).
# FAULT_LOAD_LAYER: the vLLM tests' fault hook (kvtier.integrations.vllm.layerwise).
_NOT_KEYS = {"CONFIG_FILE", "LOG_LEVEL", "CI", "ADMIN_URL", "QUALITY_CACHE", "FAULT_LOAD_LAYER"}
MIN_TOKEN_CHARS = 16

# Set while Config.diagnose builds a config: the combination rules append every problem
# here instead of raising the first (check-config lists them all in one run).
_COLLECTING: ContextVar[list[ConfigError] | None] = ContextVar("_COLLECTING", default=None)


@dataclass(frozen=True, slots=True)
class Config:
    """Resolved kvtier configuration. Build it with :meth:`load`; never mutate it."""

    chunk_size: int = 256
    local_cpu: bool = True
    max_local_cpu_size: int = 5 * 1024**3
    local_disk: str | None = None
    max_local_disk_size: int = 0
    remote_url: str | None = None
    cpu_codec: str = "identity"
    cpu_codec_staging: int = 0
    disk_codec: str = "identity"
    remote_codec: str = "identity"
    save_unfull_chunk: bool = False
    save_decode_cache: bool = True
    pre_caching_hash_algorithm: str = "xxh3_128"
    cache_policy: str = "REUSE"
    tenant_quotas: dict[str, TenantLimit] = field(default_factory=dict)
    use_only_staging_buffer: bool = False
    enable_pd: bool = False
    pd_role: str | None = None
    pd_buffer_size: int | None = None
    pd_buffer_device: str | None = None
    pd_peer_host: str | None = None
    pd_peer_alloc_port: tuple[int, ...] | None = None
    pd_serve_host: str = "127.0.0.1"
    pd_serve_port: tuple[int, ...] | None = None
    pd_allocation_timeout_sec: float = 10.0
    pd_auth_token: str | None = field(default=None, repr=False)  # a secret: never shown
    pd_reservation_ttl_sec: float = 120.0
    pd_max_connections: int = 64
    pd_idle_timeout_sec: float = 300.0
    pd_message_timeout_sec: float = 30.0
    transfer_channel: str | None = None
    use_layerwise: bool = False
    blocking_timeout_secs: float = 10.0
    internal_api_server_enabled: bool = False
    internal_api_server_host: str = "127.0.0.1"
    internal_api_server_port_start: int = 6999
    admin_token: str | None = None
    cache_salt: str = ""
    server_socket: str | None = None
    server_max_clients: int = 64
    server_salt_quota: int | None = None
    server_max_memory: int | None = None
    server_model_idle_secs: float = 300.0
    server_client_pin_share: float = 0.5
    server_client_max_requests: int = 4096
    server_client_max_tokens: int = 1 << 23
    p2p_listen: str | None = None
    p2p_peers: tuple[str, ...] | None = None
    p2p_auth_token: str | None = field(default=None, repr=False)  # a secret: never shown
    p2p_lease_secs: float = 3.0
    extra_config: dict[str, Any] = field(default_factory=dict)
    # Where each non-default value came from ("file /x.yaml", "env KVTIER_CHUNK_SIZE", ...).
    origin: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        errors = combination_errors(self)
        collecting = _COLLECTING.get()
        if collecting is not None:
            collecting.extend(errors)
        elif errors:
            raise errors[0]

    # -- loading ---------------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str] | None = None,
        *,
        overrides: Mapping[str, object] | None = None,
        env: Mapping[str, str] | None = None,
        overrides_from: str = "override",
    ) -> Config:
        """Resolve a config from defaults, a YAML file, the environment and ``overrides``
        (named ``overrides_from`` wherever a value's source is shown)."""
        return cls._resolve(path, overrides, env, overrides_from, None)

    @classmethod
    def diagnose(
        cls,
        path: str | os.PathLike[str] | None = None,
        *,
        env: Mapping[str, str] | None = None,
        ignored: dict[str, str] | None = None,
        overrides: Mapping[str, object] | None = None,
        overrides_from: str = "override",
    ) -> tuple[Config | None, list[ConfigError]]:
        """Every problem of a config at once (``kvtier check-config``, a vLLM that cannot
        start), where :meth:`load` raises the first: the config with each bad key at its
        default, and the errors. None for the config when there is none to show (the file
        unreadable or not YAML). ``ignored`` gets each LMCache key given that kvtier drops
        (key -> why); ``overrides``: as :meth:`load`'s."""
        errors: list[ConfigError] = []
        token = _COLLECTING.set(errors)
        try:
            resolved = cls._resolve(path, overrides, env, overrides_from, errors, ignored)
            return resolved, errors
        except ConfigError as exc:
            return None, [*errors, exc]
        finally:
            _COLLECTING.reset(token)

    @classmethod
    def _resolve(
        cls,
        path: str | os.PathLike[str] | None,
        overrides: Mapping[str, object] | None,
        env: Mapping[str, str] | None,
        overrides_from: str,
        errors: list[ConfigError] | None,
        ignored: dict[str, str] | None = None,
    ) -> Config:
        """:meth:`load`; with ``errors``, each problem is appended there and loading goes on
        (a bad value gives way to its key's default)."""
        env = os.environ if env is None else env
        given: lmcache.Raw = {}  # key -> (value, source), every source, later wins

        file_path = path or env.get("KVTIER_CONFIG_FILE") or env.get("LMCACHE_CONFIG_FILE")
        if file_path:
            for key, value in _read_yaml(Path(file_path)).items():
                given[key] = (value, f"file {file_path}")

        for prefix, lmcache_only in (("LMCACHE_", True), ("KVTIER_", False)):
            for name, value in sorted(env.items()):
                if not name.startswith(prefix) or name[len(prefix) :] in _NOT_KEYS:
                    continue
                key = name[len(prefix) :].lower()
                spec = KEYS_BY_NAME.get(key)
                if lmcache_only and spec is not None and not spec.lmcache:
                    continue  # kvtier's own keys are read from KVTIER_* only
                # A secret (or a path) is taken as written: YAML would read an empty one as
                # "none" (no auth, the default path) and "0123" or "yes" as a number or a bool.
                as_written = spec is not None and (spec.secret or spec.verbatim)
                parsed = value if as_written else _env_value(value)
                given[key] = (parsed, f"env {name}")

        for key, value in (overrides or {}).items():
            given[key] = (value, overrides_from)

        # LMCache's own names for what kvtier has (or refusals naming what kvtier offers).
        lmcache.translate(given, lambda line: log.info("LMCache config: %s", line), errors, ignored)
        raw = {key: value for key, (value, _) in given.items() if key in KEYS_BY_NAME}
        origin = {key: source for key, (_, source) in given.items() if key in KEYS_BY_NAME}
        unknown = {k: src for k, (_, src) in given.items() if k not in KEYS_BY_NAME}
        if errors is None:
            check_unknown(unknown)
        else:
            errors.extend(unknown_key_errors(unknown))
        values: dict[str, Any] = {}
        for spec in KEYS:
            try:
                values[spec.name] = spec.parse(spec.name, raw.get(spec.name, spec.default))
            except ConfigError as exc:
                if errors is None:
                    raise
                errors.append(exc)
                values[spec.name] = spec.parse(spec.name, spec.default)
                origin.pop(spec.name, None)
        if errors is None:
            log.info("%s", sources_line(file_path, origin))
        return cls(**values, origin=origin)

    @classmethod
    def default(cls) -> Config:
        """The defaults alone, ignoring files and the environment."""
        return cls.load(env={})

    def with_overrides(self, **overrides: object) -> Config:
        """A copy with some keys replaced, each parsed and validated like any other source."""
        parsed: dict[str, Any] = {}
        for key, value in overrides.items():
            spec = KEYS_BY_NAME.get(key)
            if spec is None:
                raise ConfigError(key, value, "not a kvtier config key")
            parsed[key] = spec.parse(key, value)
        origin = {**self.origin, **dict.fromkeys(overrides, "override")}
        return replace(self, **parsed, origin=origin)

    def as_dict(self, *, mask_secrets: bool = True) -> dict[str, Any]:
        """Key -> value for every key; secrets shown as ``'***'`` unless asked otherwise."""
        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name == "origin":
                continue
            value = getattr(self, f.name)
            if mask_secrets and KEYS_BY_NAME[f.name].secret and value:
                value = "***"
            elif mask_secrets and f.name == "remote_url" and value:
                from kvtier.config.remote_url import mask_password

                value = mask_password(value)
            elif mask_secrets and f.name == "extra_config":
                value = {
                    k: "***" if lmcache.secret_extra_key(k) and v else v for k, v in value.items()
                }
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def __repr__(self) -> str:
        """Every key with secrets masked (as :meth:`as_dict`): a config printed in a log, a
        traceback or an f-string never shows the admin token or the Redis password."""
        shown = ", ".join(f"{k}={v!r}" for k, v in self.as_dict().items())
        return f"Config({shown})"

    __str__ = __repr__

    @property
    def lower_tiers_configured(self) -> bool:
        """True when some tier below CPU (disk, remote) is configured."""
        return bool(self.local_disk or self.remote_url)


def sources_line(file_path: object, origin: Mapping[str, str]) -> str:
    """Where a config's values came from, in one line (logged at every load: the start-up
    line of a server or a vLLM worker says which file and variables it read)::

        kvtier config: file /etc/kvtier.yaml (chunk_size, local_disk); env KVTIER_*
        (max_local_cpu_size); env LMCACHE_* (none); the other keys at their defaults
    """
    groups: dict[str, list[str]] = {}
    for key, source in origin.items():
        if source.startswith("env KVTIER_"):
            source = "env KVTIER_*"
        elif source.startswith("env LMCACHE_"):
            source = "env LMCACHE_*"
        groups.setdefault(source, []).append(key)
    if file_path:
        keys = ", ".join(groups.pop(f"file {file_path}", [])) or "no keys"
        parts = [f"file {file_path} ({keys})"]
    else:
        parts = ["no file ($KVTIER_CONFIG_FILE and $LMCACHE_CONFIG_FILE unset)"]
    for env in ("env KVTIER_*", "env LMCACHE_*"):
        parts.append(f"{env} ({', '.join(groups.pop(env, [])) or 'none'})")
    parts += [f"{source} ({', '.join(keys)})" for source, keys in groups.items()]
    return f"kvtier config: {'; '.join(parts)}; the other keys at their defaults"


def _read_yaml(path: Path) -> dict[str, object]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(
            "config file", str(path), f"a readable YAML file ({exc.strerror})"
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError("config file", str(path), f"valid YAML ({exc})") from None
    if data is None:
        return {}
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise ConfigError(
            "config file", str(path), f"a YAML mapping of key: value, got {type(data).__name__}"
        )
    return data


def _env_value(text: str) -> object:
    """Environment values are YAML scalars: 'true', '5.0', '[8100, 8101]', '512MiB'."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def combination_errors(cfg: Config) -> list[ConfigError]:
    """Every broken rule that involves more than one key (none: an empty list)."""
    errors: list[ConfigError] = []
    try:
        _check_combinations(cfg, errors.append)
    except ConfigError as exc:  # check_channel's (nixl unavailable) raises
        errors.append(exc)
    return errors


def _check_combinations(cfg: Config, fail: Callable[[ConfigError], None]) -> None:
    """Rules that involve more than one key; ``fail`` gets each broken one."""
    if cfg.max_local_cpu_size <= 0:
        fail(
            ConfigError(
                "max_local_cpu_size",
                cfg.max_local_cpu_size,
                "above 0: CPU memory is the cache or, with local_cpu false, the staging buffer",
            )
        )
    if cfg.cpu_codec != "identity" and not cfg.local_cpu and cfg.use_only_staging_buffer:
        fail(
            ConfigError(
                "cpu_codec",
                cfg.cpu_codec,
                "'identity' when the CPU memory is staging only (local_cpu false, "
                "use_only_staging_buffer true): it caches nothing to encode",
            )
        )
    if cfg.local_disk and cfg.max_local_disk_size <= 0:
        fail(
            ConfigError(
                "max_local_disk_size", cfg.max_local_disk_size, "above 0 when local_disk is set"
            )
        )
    if cfg.use_only_staging_buffer and not cfg.local_cpu and not cfg.lower_tiers_configured:
        fail(
            ConfigError(
                "use_only_staging_buffer",
                True,
                "false unless local_disk or remote_url is set (staging needs a tier to stage for)",
            )
        )
    if cfg.enable_pd and cfg.pd_role is None:
        fail(ConfigError("pd_role", None, "'sender' or 'receiver' when enable_pd is true"))
    if cfg.enable_pd and cfg.pd_role == "receiver" and cfg.pd_buffer_size is None:
        fail(ConfigError("pd_buffer_size", None, "a size in bytes for a PD receiver"))
    # A sender naming no decoder: decoders pull from it (xPyD, kvtier.pd.source), out of a
    # send buffer that holds each request's chunks until its decoder comes.
    pulled = cfg.enable_pd and cfg.pd_role == "sender" and not cfg.pd_peer_alloc_port
    if pulled and cfg.pd_buffer_size is None:
        fail(
            ConfigError(
                "pd_buffer_size",
                None,
                "a size in bytes for a PD sender with no pd_peer_alloc_port (decoders pull "
                "from its send buffer); or name the one decoder it pushes to with "
                "pd_peer_host and pd_peer_alloc_port",
            )
        )
    if cfg.pd_auth_token is not None and len(cfg.pd_auth_token.strip()) < MIN_TOKEN_CHARS:
        # Set but empty or short: refused, never taken as "auth off" or as a guessable key
        # (the handshake's proofs let an eavesdropper try tokens offline). Never echoed.
        fail(
            ConfigError(
                "pd_auth_token",
                f"<{len(cfg.pd_auth_token)} characters>",
                f"at least {MIN_TOKEN_CHARS} characters other than whitespace, e.g. the output of "
                "python -c 'import secrets; print(secrets.token_urlsafe(32))'",
            )
        )
    if cfg.p2p_auth_token is not None and len(cfg.p2p_auth_token.strip()) < MIN_TOKEN_CHARS:
        fail(
            ConfigError(
                "p2p_auth_token",
                f"<{len(cfg.p2p_auth_token)} characters>",
                f"at least {MIN_TOKEN_CHARS} characters other than whitespace, the same on every "
                "peer (e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')",
            )
        )
    if cfg.p2p_peers and cfg.p2p_listen is None:
        fail(
            ConfigError(
                "p2p_listen",
                None,
                "host:port this server's peers reach it at, when p2p_peers is set (a peer that "
                "reads others' chunks announces its own)",
            )
        )
    if cfg.server_socket is not None and not cfg.server_socket.strip():
        # An empty KVTIER_SERVER_SOCKET is a mistake (an unset variable expanded), never
        # a quiet "use the default".
        fail(
            ConfigError(
                "server_socket", cfg.server_socket, "an absolute path or unix:///absolute/path URL"
            )
        )
    for key in ("server_salt_quota", "server_max_memory"):
        if getattr(cfg, key) == 0:
            fail(ConfigError(key, 0, "a size above 0 (every model would be refused), or null"))
    if cfg.enable_pd and cfg.transfer_channel == "nixl":
        check_channel(cfg.transfer_channel)  # raises, naming why nixl is unavailable
