#!/usr/bin/env bash
# Prepare what bench/gpu_check.sh needs on a GPU machine that has torch (CUDA), grpcio,
# protobuf and transformers but no Redis and no network: run this HERE (with network),
# it fills bench/gpu_deps/ (gitignored), which travels with the working tree.
#
#   bench/gpu_prepare.sh                 # wheels for CPython 3.10-3.13, redis-server from Debian 12
#   PYVERS="3.11" bench/gpu_prepare.sh   # only the GPU machine's Python
#
# bench/gpu_deps/wheels/  binary wheels (manylinux x86_64, --no-deps) of the project's
#                         runtime dependencies the GPU machine lacks (redis-py + hiredis,
#                         xxhash, sentencepiece, prometheus-client, grpcio health and
#                         reflection) and pytest for the parity checks.
# bench/gpu_deps/redis/   redis-server unpacked from Debian's redis-tools package with the
#                         shared libraries it links and Debian's own glibc loader, and a
#                         wrapper bin/redis-server that runs it through that loader (so the
#                         binary runs whatever glibc the GPU machine has).
set -euo pipefail
cd "$(dirname "$0")"
DEPS="$PWD/gpu_deps"
PYVERS="${PYVERS:-3.10 3.11 3.12 3.13}"
mkdir -p "$DEPS/wheels" "$DEPS/debs" "$DEPS/redis"

PKGS=(redis hiredis xxhash sentencepiece prometheus-client grpcio-health-checking grpcio-reflection
      pytest pluggy iniconfig packaging)
for v in $PYVERS; do
    echo "== wheels for CPython $v"
    python3 -m pip download --quiet --no-deps --only-binary=:all: --dest "$DEPS/wheels" \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
        --python-version "$v" --implementation cp "${PKGS[@]}"
done

echo "== redis-server from Debian"
DEBS=(redis-tools libjemalloc2 liblzf1 libatomic1 libssl3 libsystemd0 libc6 libgcc-s1 libstdc++6
      libcap2 libgcrypt20 libgpg-error0 liblz4-1 liblzma5 libzstd1)
( cd "$DEPS/debs" && apt-get download "${DEBS[@]}" )
for deb in "$DEPS"/debs/*.deb; do dpkg-deb -x "$deb" "$DEPS/redis/root"; done
mkdir -p "$DEPS/redis/bin" "$DEPS/redis/lib"
cp "$DEPS/redis/root/usr/bin/redis-check-rdb" "$DEPS/redis/bin/redis-server.real"
cp "$DEPS/redis/root/usr/bin/redis-cli" "$DEPS/redis/bin/redis-cli.real"
find "$DEPS/redis/root" \( -name 'lib*.so*' -o -name 'ld-linux*' \) -not -path '*/gconv/*' -type f -exec cp {} "$DEPS/redis/lib/" \;
find "$DEPS/redis/root" \( -name 'lib*.so*' -o -name 'ld-linux*' \) -not -path '*/gconv/*' -type l | while read -r link; do  # e.g. libssl.so.3 -> libssl.so.3.x
    [ -e "$DEPS/redis/lib/$(basename "$link")" ] || ln -s "$(basename "$(readlink "$link")")" "$DEPS/redis/lib/$(basename "$link")"
done
for tool in redis-server redis-cli; do
    cat > "$DEPS/redis/bin/$tool" <<WRAP
#!/bin/sh
# $tool from Debian 12, run through Debian's own loader and libraries (bench/gpu_prepare.sh)
here="\$(cd "\$(dirname "\$0")/.." && pwd)"
exec "\$here/lib/ld-linux-x86-64.so.2" --library-path "\$here/lib" --argv0 $tool "\$here/bin/$tool.real" "\$@"
WRAP
    chmod +x "$DEPS/redis/bin/$tool"
done
rm -rf "$DEPS/redis/root" "$DEPS/debs"
"$DEPS/redis/bin/redis-server" --version
du -sh "$DEPS"
