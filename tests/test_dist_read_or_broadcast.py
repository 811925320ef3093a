"""`hpckpt.dist.load`'s choice between reading a shared box on every holder and broadcasting it:
the pure decision (`dist.read_or_broadcast.choose`), the figures as configured (`dist.bandwidths`),
and what a one-process load says. Real multi-process loads with each choice:
tests/dist_scripts/fsdp_job.py (HSDP 2x2, `test_dist_fsdp.py`)."""

from __future__ import annotations

import pytest

from hpckpt.dist.bandwidths import Figure, configured, parse_bandwidth
from hpckpt.dist.read_or_broadcast import choose, overall

GiB = 2**30


def test_broadcast_pays_when_the_other_holders_reads_cost_more_than_the_broadcast():
    # gloo on one host: a broadcast at 0.9 GB/s against a page cache read at 4 GiB/s: read
    assert choose(2, 1 * GiB, 4 * GiB, 0.9e9)[0] == "read"
    # nccl: 100 GiB/s against a file system at 2 GiB/s: broadcast
    choice, read_s, broadcast_s = choose(2, 1 * GiB, 2 * GiB, 100 * GiB)
    assert choice == "broadcast" and read_s == pytest.approx(1.0) and broadcast_s == pytest.approx(0.51)
    # the same figures, more holders: (holders - 1) * network against storage, the size cancels
    assert [choose(k, 5, 2 * GiB, 1 * GiB)[0] for k in (2, 3, 4)] == ["read", "read", "broadcast"]
    assert {choose(4, n, 2 * GiB, 1 * GiB)[0] for n in (1, 10**6, 10**12)} == {"broadcast"}


def test_holders_on_one_machine_read_it_once_and_copy_the_rest_from_its_page_cache():
    # 4 holders, 2 GiB/s storage, a 1 GiB/s network: blind to machines, broadcasting wins (3 x 1 > 2)
    assert choose(4, GiB, 2 * GiB, 1 * GiB)[0] == "broadcast"
    # on one machine the storage is read once and the others copy from memory (8 GiB/s): read
    choice, read_s, broadcast_s = choose(4, GiB, 2 * GiB, 1 * GiB, hosts=1, memory_bps=8 * GiB)
    assert choice == "read" and read_s == pytest.approx(0.5 + 0.125) and broadcast_s == pytest.approx(1.5)
    # on one machine only a network faster than memory (nccl over NVLink) makes broadcasting pay
    assert choose(4, GiB, 2 * GiB, 100 * GiB, hosts=1, memory_bps=8 * GiB)[0] == "broadcast"
    # 8 holders on 2 machines: 2 reads of the storage, against one read and a broadcast
    assert choose(8, GiB, 2 * GiB, 1 * GiB, hosts=2, memory_bps=8 * GiB)[0] == "read"
    assert choose(8, GiB, 1 * GiB, 4 * GiB, hosts=2, memory_bps=8 * GiB)[0] == "broadcast"


def test_ties_and_lone_holders_read_and_unknown_figures_broadcast():
    assert choose(2, 100, 1 * GiB, 1 * GiB)[0] == "read"  # a tie: no collective
    assert choose(1, 100, None, None) == ("read", None, None)
    for storage, network in ((None, GiB), (GiB, None), (0, GiB), (GiB, -1.0)):
        assert choose(3, 100, storage, network) == ("broadcast", None, None)


def test_overall():
    assert overall([]) == "read" and overall(["read", "read"]) == "read"
    assert overall(["broadcast"]) == "broadcast" and overall(["read", "broadcast", "read"]) == "mixed"


def test_bandwidths_given_as_sizes_per_second(monkeypatch):
    assert parse_bandwidth("2GiB", "x") == 2 * GiB == parse_bandwidth("2 GiB/s", "x")
    assert parse_bandwidth("800MB/s", "x") == 800e6 and parse_bandwidth(1.5e9, "x") == 1.5e9
    for bad in ("fast", "0", -3, "2GiB/h"):
        with pytest.raises(ValueError, match="bandwidth"):
            parse_bandwidth(bad, "x")
    monkeypatch.delenv("HPCKPT_NETWORK_BANDWIDTH", raising=False)
    assert configured(None, "HPCKPT_NETWORK_BANDWIDTH") is None
    monkeypatch.setenv("HPCKPT_NETWORK_BANDWIDTH", "10GiB")
    assert configured(None, "HPCKPT_NETWORK_BANDWIDTH") == Figure(10 * GiB, "environment")
    assert configured("1GiB", "HPCKPT_NETWORK_BANDWIDTH") == Figure(GiB, "argument")  # the argument first


def test_a_one_process_load_shares_nothing_and_checks_its_arguments(tmp_path):
    import torch

    import hpckpt.dist as hdist

    hdist.save({"w": torch.arange(6.0)}, tmp_path / "ck", no_dist=True)
    target = {"w": torch.zeros(6)}
    loaded = hdist.load(target, tmp_path / "ck", no_dist=True, network_bandwidth="1GiB")
    assert torch.equal(target["w"], torch.arange(6.0))
    assert (loaded.broadcast, loaded.broadcast_reason, loaded.shared_groups) == ("read", "nothing shared", ())
    assert loaded.storage_bandwidth is None and loaded.network_bandwidth_from == ""
    with pytest.raises(ValueError, match="broadcast_shared"):
        hdist.load(target, tmp_path / "ck", no_dist=True, broadcast_shared="sometimes")
    with pytest.raises(ValueError, match="storage_bandwidth: not a bandwidth"):
        hdist.load(target, tmp_path / "ck", no_dist=True, storage_bandwidth="quick")
