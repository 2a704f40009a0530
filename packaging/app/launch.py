"""Entry point of the packaged desktop app (PyInstaller runs this file; it is ``sharpi-gui``)."""

import sys

from sharpi_gui.app import main

if __name__ == "__main__":
    sys.exit(main())
