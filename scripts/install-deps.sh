#!/usr/bin/env bash
# Installs every system package meshwarp needs to build, test and run its demo on a
# fresh Debian machine. Idempotent: packages already present are left alone.
set -euo pipefail

PKGS=(clang llvm libelf-dev zlib1g-dev pkg-config make iproute2 iptables bpftool procps)
# The compatibility suite drives real programs through the fast path.
PKGS+=(haproxy nginx-light socat redis-server redis-tools curl openssl python3 memcached libmemcached-tools python3-grpcio postgresql nodejs nghttp2-server nghttp2-client iperf3)
# Extra packages named on the command line (e.g. the mesh benchmark's nginx, haproxy, wrk).
PKGS+=("$@")
# The compatibility suite builds a Go program (and the chart test builds helm
# with Go): Debian's Go where the machine has none.
command -v go >/dev/null 2>&1 || PKGS+=(golang-go)
# ... and runs a Java program from source (the JDK's launcher compiles it).
command -v javac >/dev/null 2>&1 || PKGS+=(default-jdk-headless)

missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ "${#missing[@]}" -gt 0 ]; then
  echo "install-deps: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  # Packages such as nginx and redis-server would start their services on the
  # host's ports; the tests start their own copies inside namespaces.
  policy=/usr/sbin/policy-rc.d
  made_policy=""
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$policy" >/dev/null
    $SUDO chmod +x "$policy"
    made_policy=1
    trap '$SUDO rm -f "$policy"' EXIT
  fi
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

if ! command -v cargo >/dev/null 2>&1; then
  echo "install-deps: cargo not found; install Rust (rustup) first" >&2
  exit 1
fi
# rustfmt and clippy are part of `make test`.
rustup component add rustfmt clippy >/dev/null 2>&1 || true

# The Helm chart's test (crates/cli/tests/deploy.rs) lints and renders it with
# helm. Debian has no helm package and download sites are unreachable here, so
# it is built from the Go module proxy (about two minutes, once per machine).
HELM_VERSION=v3.19.0
if ! command -v helm >/dev/null 2>&1; then
  if command -v go >/dev/null 2>&1; then
    echo "install-deps: building helm $HELM_VERSION from the Go module proxy"
    if [ "$(id -u)" -eq 0 ]; then
      GOBIN=/usr/local/bin go install "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
    else
      go install "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
      echo "install-deps: helm is in $(go env GOPATH)/bin: add it to PATH" >&2
    fi
  else
    echo "install-deps: go not found: helm cannot be built; the chart test fails under CI=true" >&2
  fi
fi
