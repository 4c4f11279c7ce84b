"""Which inference-service RPCs each bearer token opens, written once: ``server/frontend/auth.py``
checks them in Python, and the native build generates ``auth.cc``'s sets from here
(``server/native/generate_rules.py``)."""

from __future__ import annotations

ADMIN_METHODS = frozenset({
    "RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload", "LogSettings",
    "TraceSetting",
    # They open files and device memory on the server's host by name.
    "SystemSharedMemoryStatus", "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister",
    "CudaSharedMemoryStatus", "CudaSharedMemoryRegister", "CudaSharedMemoryUnregister",
})
"""Guarded by the admin token (by the infer token when only that one is set)."""
OPEN_METHODS = frozenset({"ServerLive", "ServerReady"})
"""Never guarded: probes and load balancers call them without credentials."""
METADATA_KEY = "authorization"
"""The metadata entry that carries ``Bearer <token>``."""
