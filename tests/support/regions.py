"""The names of the shared-memory regions the tests' own clients create in /dev/shm.

A test that checks a server left nothing in /dev/shm must tell these apart: on a machine where
another suite (or another pytest-xdist worker) runs at once, they come and go beside the server
under test.
"""

# test_native_parity's regions, registered with every server of that module.
PARITY_REGION_PREFIX = "batchgate_parity_"
# test_shared_memory's regions (tritonclient's and the hand-made ones).
CLIENT_REGION_PREFIX = "bg_"
CLIENT_REGION_PREFIXES = (PARITY_REGION_PREFIX, CLIENT_REGION_PREFIX)


def servers_leftovers(names) -> set[str]:
    """``names`` (of /dev/shm) less the tests' clients' regions."""
    return {name for name in names if not name.startswith(CLIENT_REGION_PREFIXES)}
