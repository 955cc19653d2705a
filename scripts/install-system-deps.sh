#!/usr/bin/env bash
# Installs the Debian packages the test suite uses for real and the header kvtier's C extension
# is built with, only when they are missing.
set -euo pipefail
need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || need+=(redis-tools)
command -v openssl >/dev/null 2>&1 || need+=(openssl)  # TLS certificates for the rediss:// test
# Headless browser for the dashboard test (tests/admin/test_dashboard.py).
command -v chromium >/dev/null 2>&1 || need+=(chromium)
# systemd-analyze verifies docs/server.md's unit (tests/docs/test_server_doc.py): under
# KVTIER_CI a test skipped for want of it fails (tests/hosts.py), so CI must have it.
command -v systemd-analyze >/dev/null 2>&1 || need+=(systemd)
# xxhash.h (header only) for the copy fused with the PD checksum in kvtier's C extension; it
# must be here before kvtier is installed (the Makefile runs this first).
echo '#include <xxhash.h>' | cc -E -x c - >/dev/null 2>&1 || need+=(libxxhash-dev)
if [ ${#need[@]} -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "installing ${need[*]} from Debian's packages"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi
