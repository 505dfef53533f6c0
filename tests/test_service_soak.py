"""A shortened soak (tools/soak.py): mixed traffic (chat and completions, streamed and not, abandoned streams,
client timeouts, bad requests, embeddings) against ``inferflow-service`` for a few seconds; every answer is the
designed one, resident memory stays flat after the warm-up, and the KV pool ends fully free."""
import pytest

from service_helpers import chat_llama, tiny_bert
from tools.service_process import ServiceProcess
from tools.soak import soak

DURATION = 16.0


def test_short_soak(tmp_path, one_thread):
    config = {"models": [
        {"name": "tiny", "source": str(chat_llama(tmp_path / "tiny")), "overrides": {"max_position_embeddings": 2048},
         "engine": {"num_blocks": 160, "max_num_seqs": 8}},
        {"name": "embed", "source": str(tiny_bert(tmp_path / "embed"))}]}
    with ServiceProcess(config) as svc:
        report = soak(svc.url, svc.pid, duration=DURATION, clients=6, warmup=0.4)
        status = svc.stop()
    print(report)
    assert status == 0
    assert not report["problems"], report["problems"]
    kinds = {k.split()[0] for k in report["counts"]}
    assert {"chat", "chat_stream", "completion_stream", "cancel_stream", "bad_json", "embeddings"} <= kinds, kinds
    assert report["pool_idle"], report["pool"]
    tiny = report["pool"]["tiny"]
    assert tiny["requests_aborted"] > 0 and tiny["requests_failed"] == 0
    rss = report["rss_mib"]
    if not rss["end"]:
        pytest.skip("no /proc: RSS not measured")
    assert rss["growth_after_warmup"] < 24, rss  # a leak per request would show: hundreds of requests ran
