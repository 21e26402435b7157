"""No import circle anywhere in the project's packages: no module reaches itself through others.

(An import circle crossed the process boundary once: the executor imported the scheduler for a
type the protocol defines, and the scheduler reaches the worker, which imports the executor.)
"""

from __future__ import annotations

import grimp

PACKAGES = ("app", "model", "training", "benchmarks")


def test_no_module_imports_itself_through_others() -> None:
    graph = grimp.build_graph(*PACKAGES)
    circles = []
    for imp in graph.find_matching_direct_imports(import_expression="** -> **"):
        importer, imported = imp["importer"], imp["imported"]
        if importer == imported:
            continue
        back = graph.find_shortest_chain(importer=imported, imported=importer)
        if back:
            circles.append((importer, *back))
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)
