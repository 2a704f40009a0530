#!/usr/bin/env bash
# Install this unpacked bundle for the current user: the app under ~/.local/opt/sharpi, `sharpi-gui`
# on ~/.local/bin, the menu entry and the icon under ~/.local/share. Run it from the unpacked folder.
set -euo pipefail
SRC=$(cd "$(dirname "$0")" && pwd)
PREFIX=${PREFIX:-$HOME/.local}
mkdir -p "$PREFIX/opt" "$PREFIX/bin"
rm -rf "$PREFIX/opt/sharpi"
cp -a "$SRC" "$PREFIX/opt/sharpi"
ln -sf "$PREFIX/opt/sharpi/sharpi-gui" "$PREFIX/bin/sharpi-gui"
install -D -m 644 "$SRC/share/applications/sharpi.desktop" "$PREFIX/share/applications/sharpi.desktop"
install -D -m 644 "$SRC/share/icons/hicolor/scalable/apps/sharpi.svg" "$PREFIX/share/icons/hicolor/scalable/apps/sharpi.svg"
sed -i "s|^Exec=sharpi-gui|Exec=$PREFIX/bin/sharpi-gui|; s|^TryExec=sharpi-gui|TryExec=$PREFIX/bin/sharpi-gui|" \
    "$PREFIX/share/applications/sharpi.desktop"
command -v update-desktop-database >/dev/null && update-desktop-database "$PREFIX/share/applications" || true
echo "installed: $PREFIX/bin/sharpi-gui and the SharpI menu entry"
