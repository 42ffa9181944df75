"""End to end: what users do to Adapters, behind a plain Service, fails no request (issue 39).

The stand-in cluster of ``test_cluster_serving_e2e.py`` (kmock for the API, ``kubelet.py``
running real ``loraserve-runtime`` processes with the tiny CPU model, the real operator),
with ``service.py`` as a plain Service: a random Ready endpoint per request, a pod the
moment it turns Ready, a terminating pod for 1 s more, no retries. Each phase runs its own
traffic (greedy streams of ``Operations.max_tokens`` tokens, ~1 s each, in flight) through it; the phases are
``scenario.Operations``' (shared with ``bench/operator.py --scenario cluster``):

a. an Adapter's source changes in place under load: every answer is the old or the new
   version's; then every pod serves the new one;
c. scale 3 -> 1;
b. scale 1 -> 3 on a slow node (model loads take seconds, ConfigMap volumes refresh every
   minute) with an Adapter created while the new pods load: each new pod, asked the moment
   it turns Ready, serves it;
d. three pods fetch one ``hf://`` adapter from a local hub into their shared cache at once:
   all succeed, one download per file;
e. a source that accepts and never answers: 503 ``adapter_loading`` within the serve's
   ``loadTimeoutSeconds``, other adapters unaffected, the status says why within seconds.

The tests run in order on one cluster (module scope).
"""

from __future__ import annotations

import sys

import pytest
import pytest_asyncio

cluster_mod = sys.modules["_loraserve_e2e_cluster"]
scenario_mod = cluster_mod.load_sibling("scenario")
Plan = scenario_mod.AdapterPlan

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(900)]

NS = SERVE = "ops"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def ops(cluster):
    await cluster.start_operator(scenario_mod.operator_config())
    try:
        operations = await scenario_mod.Operations.open(
            cluster, NS, SERVE, say=lambda line: print(line, flush=True)
        )
        try:
            yield operations
        finally:
            await operations.close()
    finally:
        await cluster.stop_operator()


def _check(result) -> None:
    print("\n".join([result.name, *result.notes, f"{len(result.records)} requests, {result.seconds:.1f} s"]))
    assert not result.failed() and not result.problems, result.report()


async def test_version_change(ops) -> None:
    result = await ops.version_change()
    _check(result)
    assert sum(r.model == "alpha" and r.ok for r in result.records) >= 10


async def test_scale_down(ops) -> None:
    _check(await ops.scale(1))
    assert len(ops.scn.pods()) == 1


async def test_created_while_pods_load(ops) -> None:
    result = await ops.create_while_loading()
    _check(result)
    assert len(result.probes) == 2 and all(r.status == 200 for r in result.probes)


async def test_shared_cache_fetch(ops) -> None:
    result = await ops.shared_fetch()
    _check(result)
    assert len(result.probes) == 6 and ops.hub.downloads("remote")


async def test_hung_source(ops) -> None:
    result = await ops.hung_source()
    _check(result)
    assert ops.hub.held >= 1, "no pod reached the hung source"
