#!/usr/bin/env bash
# The packaged desktop app: build it with PyInstaller, then launch it under Xvfb and have it answer one
# question (sharpi-gui --ask). CI-runnable; needs the project and pyinstaller installed in $PYTHON's
# environment (pip install -e '.[package]') and xvfb-run (apt-get install xvfb xauth).
#
#   bash packaging/build_app.sh            # build + smoke test; prints the build time and bundle size
#   SHARPI_APP_OUT=/tmp/app bash packaging/build_app.sh
#   SHARPI_APP_SKIP_BUILD=1 bash packaging/build_app.sh   # the smoke test of the bundle built before
#
# Output under $SHARPI_APP_OUT (default packaging/build/app): dist/sharpi/ (the bundle: sharpi-gui,
# the demo model, share/applications/sharpi.desktop, share/icons/…/sharpi.svg) and sharpi-linux-<arch>.tar.gz.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=$(realpath -m "${SHARPI_APP_OUT:-packaging/build/app}")
QUESTION=${SHARPI_APP_QUESTION:-What is a generator?}
# Pinned inputs for a reproducible bundle: bytecode and archive timestamps from the commit, fixed hashing.
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || echo 0)}
export PYTHONHASHSEED=0

APP="$OUT/dist/sharpi"
start=$(date +%s)
if [ "${SHARPI_APP_SKIP_BUILD:-0}" = 1 ]; then
    [ -x "$APP/sharpi-gui" ] || { echo "no bundle at $APP to test" >&2; exit 1; }
else
    echo "== build (PyInstaller $($PY -m PyInstaller --version))"
    $PY -m PyInstaller --noconfirm --clean --log-level WARN \
        --distpath "$OUT/dist" --workpath "$OUT/work" packaging/app/sharpi.spec
    install -D -m 644 sharpi_gui/sharpi.svg "$APP/share/icons/hicolor/scalable/apps/sharpi.svg"
    install -m 755 packaging/app/install.sh "$APP/install.sh"
    ARCHIVE="$OUT/sharpi-linux-$(uname -m).tar.gz"
    tar --sort=name --mtime="@$SOURCE_DATE_EPOCH" --owner=0 --group=0 --numeric-owner \
        -C "$OUT/dist" -cf - sharpi | gzip -n > "$ARCHIVE"
    echo "build: $(($(date +%s) - start)) s; bundle $(du -sh "$APP" | cut -f1) on disk, archive $(du -h "$ARCHIVE" | cut -f1)"
fi
built=$(date +%s)

echo "== smoke test: the bundle under Xvfb answers one question"
command -v xvfb-run >/dev/null || { echo "xvfb-run not found: apt-get install xvfb xauth" >&2; exit 1; }
HOME_DIR=$(mktemp -d)  # a first launch: no settings, no conversations, no numba cache
trap 'rm -rf "$HOME_DIR"' EXIT
set +e
env -i PATH=/usr/bin:/bin HOME="$HOME_DIR" XDG_CONFIG_HOME="$HOME_DIR/.config" XDG_DATA_HOME="$HOME_DIR/.local/share" \
    XDG_CACHE_HOME="$HOME_DIR/.cache" QT_QPA_PLATFORM=xcb LANG=C.UTF-8 \
    xvfb-run -a -s "-screen 0 1600x1000x24" "$APP/sharpi-gui" --ask "$QUESTION" --timeout "${SHARPI_APP_TIMEOUT:-900}" --screenshot "$OUT/answered.png" \
    > "$OUT/answer.txt"
rc=$?
set -e
done_at=$(date +%s)
echo "answer ($((done_at - built)) s from launch, first run: kernels compile):"
cat "$OUT/answer.txt"
if [ $rc -ne 0 ] || [ ! -s "$OUT/answer.txt" ]; then
    echo "the packaged app did not answer (exit status $rc)" >&2
    exit 1
fi
echo "the window once answered: $OUT/answered.png"
echo "ok: built in $((built - start)) s, answered in $((done_at - built)) s"
