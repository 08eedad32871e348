# meshwarp: the two commands are `make demo` and `make test` (as root, on Debian).
CARGO ?= cargo

.PHONY: deps build demo test bench bench-mesh fmt clippy fuzz

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

# Fuzz targets (fuzz/, libFuzzer via cargo-fuzz on nightly), each for
# FUZZ_SECONDS. A crash leaves its input in fuzz/artifacts/<target>/: add it
# as a regression test before fixing.
FUZZ_SECONDS ?= 60
FUZZ_TARGETS = plugin_object proto_convert config
fuzz: deps
	rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
	$(CARGO) +nightly fuzz --version >/dev/null 2>&1 || $(CARGO) install cargo-fuzz --locked
	for t in $(FUZZ_TARGETS); do $(CARGO) +nightly fuzz run $$t -- -max_total_time=$(FUZZ_SECONDS) || exit 1; done
