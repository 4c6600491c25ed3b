#!/bin/sh
# Runs PyPI's perf-analyzer 2.60.0 on a Debian 12 (glibc 2.36) x86_64 machine.
#
# The 2.60 wheel is tagged manylinux_2_38 (its binary needs GLIBC_2.38 and GLIBCXX_3.4.32), so
# `pip install perf-analyzer` there gets the 0.1.0 placeholder instead. This script fetches the real
# wheel and Debian 13's libc6, libstdc++6 and libgcc-s1 into $PA_HOME (a cache directory; apt runs
# with its own source list and state there, the system's apt setup and libraries are not touched)
# and starts the binary with Debian 13's loader pointed at them. zlib and OpenSSL 3 come from the
# system.
#
#   benchmarks/service/perf_analyzer_glibc236.sh --version
#   python benchmarks/service/perf_analyzer.py --perf-analyzer benchmarks/service/perf_analyzer_glibc236.sh
set -eu

PA_VERSION=2.60.0
PA_HOME=${PA_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/convserve-perf-analyzer}
BIN=$PA_HOME/wheel/perf_analyzer/bin/perf_analyzer
LIBS=$PA_HOME/root/usr/lib/x86_64-linux-gnu

setup() {
    echo "perf_analyzer_glibc236.sh: fetching perf-analyzer $PA_VERSION and Debian 13 libc into $PA_HOME" >&2
    mkdir -p "$PA_HOME/apt/lists/partial" "$PA_HOME/apt/cache/archives/partial" "$PA_HOME/apt/sources" \
             "$PA_HOME/debs" "$PA_HOME/wheel" "$PA_HOME/root"
    python3 -m pip download --quiet --no-deps --only-binary=:all: --platform manylinux_2_38_x86_64 \
        "perf-analyzer==$PA_VERSION" -d "$PA_HOME"
    python3 -m zipfile -e "$PA_HOME/perf_analyzer-$PA_VERSION-py3-none-manylinux_2_38_x86_64.whl" "$PA_HOME/wheel"
    chmod +x "$BIN"
    cat > "$PA_HOME/apt/sources/trixie.sources" <<EOF
Types: deb
URIs: http://deb.debian.org/debian
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    set -- -o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$PA_HOME/apt/sources" \
           -o "Dir::State::Lists=$PA_HOME/apt/lists" -o "Dir::Cache=$PA_HOME/apt/cache" -o Debug::NoLocking=1
    apt-get -qq "$@" update >&2
    (cd "$PA_HOME/debs" && apt-get -qq "$@" download libc6 libstdc++6 libgcc-s1 >&2)
    for deb in "$PA_HOME"/debs/*.deb; do dpkg-deb -x "$deb" "$PA_HOME/root"; done
}

if [ ! -x "$BIN" ] || [ ! -e "$LIBS/ld-linux-x86-64.so.2" ]; then
    setup
fi
exec "$LIBS/ld-linux-x86-64.so.2" --library-path "$LIBS:/lib/x86_64-linux-gnu:/usr/lib/x86_64-linux-gnu" "$BIN" "$@"
