"""SharpI's desktop app (PySide6 + pyqtgraph). Only :mod:`sharpi_gui.bridge` talks to the engine."""

from sharpi_gui._qtcompat import protect_singletons

protect_singletons()
