"""The shared fixtures live in tests/support/fixtures.py, importable like every other shared helper. Here: the order
in which pytest-xdist hands the test modules out (scripts/test.sh: --dist loadfile --no-loadscope-reorder)."""

pytest_plugins = ["tests.support.fixtures"]

# A module's tier is the lowest of its tests' marks here (unmarked: 3); lower tiers take longer and go first.
TIERS = {"browser": 0, "ray": 0, "kill": 1, "slow": 2}
# Modules that start the local Ray cluster take turns for it (tests/support/ray_cluster.py): this many other modules
# are handed out between two of them, so that the other worker is busy elsewhere rather than waiting for the cluster.
RAY_SPACING = 3


def pytest_collection_modifyitems(items):
    """Order the modules longest first: browser journeys and Ray (spaced apart), process kills, the other slow ones,
    then the rest, larger modules first within a tier. A worker finishing early then finds short modules left to
    take; by pytest-xdist's own order (by number of tests) the one-test browser journeys came last, and one worker
    ran them alone after the other had finished."""
    modules: dict = {}
    for item in items:
        modules.setdefault(item.path, []).append(item)
    marks = {path: {mark.name for test in tests for mark in test.iter_markers()} for path, tests in modules.items()}

    def longest_first(path) -> tuple[int, int]:
        return min((TIERS[name] for name in marks[path] if name in TIERS), default=3), -len(modules[path])

    order, waiting, since_ray = [], [], RAY_SPACING
    for path in sorted(modules, key=longest_first):
        if "ray" in marks[path]:
            waiting.append(path)
        else:
            order.append(path)
            since_ray += 1
        if waiting and since_ray >= RAY_SPACING:
            order.append(waiting.pop(0))
            since_ray = 0
    items[:] = [item for path in order + waiting for item in modules[path]]
