"""benchmarks/vs_powerinfer.py's bytes bound: each pinfer run against the bandwidth probed just before it (the median
of per-round shares), beside the older figure (the runs' median speed against the first probe)."""

from benchmarks import vs_powerinfer as vp


def test_the_bound_pairs_each_run_with_its_own_probe(monkeypatch):
    monkeypatch.setattr(vp, "touched_bytes", lambda model, active: 200_000_000)  # 200 MB a token
    # probes 20, 25, 20 GB/s: 100, 125, 100 tok/s at most; the runs at 85, 100, 98 tok/s
    runs = [{"decode_tps": 85.0, "bandwidth_gbs": 20.0}, {"decode_tps": 100.0, "bandwidth_gbs": 25.0},
            {"decode_tps": 98.0, "bandwidth_gbs": 20.0}]
    b = vp.bound(None, 0.07, 25.0, runs)
    assert b["pinfer_shares"] == [0.85, 0.8, 0.98]
    assert b["pinfer_share_paired"] == 0.85  # the median of the shares, not the median speed over one probe
    assert b["tokens_per_s"] == 125.0 and b["pinfer_share"] == 0.784  # 98 tok/s against the first probe's 125
    assert b["round_bandwidth_gbs"] == [20.0, 25.0, 20.0] and b["bytes_per_token"] == 200_000_000
