# meshwarp: the two commands are `make demo` and `make test` (as root, on Debian).
CARGO ?= cargo

.PHONY: deps build demo test bench bench-mesh fmt clippy

deps:
	bash scripts/install-deps.sh

build: deps
	$(CARGO) build --workspace --all-targets

demo: deps
	$(CARGO) run --release -p meshwarp-cli -- demo

test: deps
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) test --workspace

bench: deps
	$(CARGO) bench -p meshwarp-benches

# The end-to-end mesh benchmark needs real programs from Debian's packages.
bench-mesh: deps
	bash scripts/install-deps.sh nginx-light haproxy wrk
	$(CARGO) run --release -p meshwarp-cli -- bench mesh
