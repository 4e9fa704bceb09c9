"""Every example's CUDA path, end to end, as the tutorials place things on GPUs. Marked gpu, and
skipped, saying why, on a machine without CUDA; on one with GPUs they run with everything else
(`make test`), or alone with `pytest -m gpu`."""

import json
import re

import numpy as np
import pytest
import torch
from conftest import find_free_port, needs_monarch, run_example

GPUS = torch.cuda.device_count()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(GPUS == 0, reason="needs CUDA, and this machine has no GPU")]
two_gpus = pytest.mark.skipif(GPUS < 2, reason=f"needs two GPUs, and this machine has {GPUS}")


def run(example, tmp_path, *args, timeout=240, script="main.py"):
    """Run an example to the end with --summary_json; (its run, its summary)."""
    summary = tmp_path / "summary.json"
    finished = run_example(example, *args, "--master_port", find_free_port(),
                           "--summary_json", summary, timeout=timeout, script=script)
    assert finished.returncode == 0, finished.output
    return finished, json.loads(summary.read_text())


@pytest.mark.parametrize("num_gpus", [1, pytest.param(2, marks=two_gpus)])
def test_param_server_puts_the_model_on_its_gpus(tmp_path, num_gpus):
    finished, summary = run("param_server", tmp_path, "--num_gpus", num_gpus, "--world_size", 2,
                            "--dataset", "synthetic", "--max_batches", 60, "--log_interval", 20)
    assert f"Using {num_gpus} GPUs to train" in finished.stdout
    assert "Putting first 2 convs on cuda:0" in finished.stdout
    assert f"Putting rest of layers on cuda:{num_gpus - 1}" in finished.stdout
    assert summary["accuracy"] >= 0.8, summary  # chance is 0.1; 0.9 and more on the CPU


def test_param_server_batch_trainers_train_on_the_gpu(tmp_path):
    finished, summary = run("param_server", tmp_path, "--world_size", 3, "--dataset",
                            "synthetic", "--max_batches", 60, "--log_interval", 20,
                            script="batch.py")
    for trainer in ("trainer1", "trainer2"):
        assert f"{trainer} trains its copy of the model on cuda:0" in finished.stdout
    assert summary["identical_final_weights"] is True and summary["short_updates"] == 0
    assert min(summary["accuracy_per_trainer"].values()) >= 0.7, summary


def test_param_server_monarch_trainers_train_on_the_gpu(tmp_path):
    needs_monarch()
    summary = tmp_path / "summary.json"
    finished = run_example("param_server", "--world_size", 3, "--dataset", "synthetic",
                           "--max_batches", 60, "--log_interval", 20, "--summary_json", summary,
                           timeout=240, script="actors.py")
    assert finished.returncode == 0, finished.output
    for trainer in ("trainer1", "trainer2"):
        assert f"{trainer} trains its copy of the model on cuda:0" in finished.stdout
    summary = json.loads(summary.read_text())
    assert summary["short_updates"] == 0
    assert min(summary["accuracy_per_trainer"].values()) >= 0.7, summary


def test_rl_cartpole_batch_puts_the_policy_on_the_gpu(tmp_path):
    finished, summary = run("rl_cartpole", tmp_path, "--world_size", 3, "--max_episodes", 30,
                            "--log_interval", 1, script="batch.py")
    assert "Agent: batched actions for 2 observer(s), policy on cuda:0" in finished.stdout
    rewards = [float(r) for r in re.findall(r"^Episode \d+\tLast reward: (\S+)\t",
                                            finished.stdout, re.M)]
    assert np.mean(rewards[-10:]) > 1.3 * np.mean(rewards[:10]), rewards  # as on the CPU
    assert summary["episodes"] == 30


def test_rnn_model_parallel_puts_the_table_on_the_gpu(tmp_path):
    finished, summary = run("rnn_model_parallel", tmp_path, "--epochs", 3)
    assert "Embedding table on ps (cuda:0), LSTM local, decoder on ps" in finished.stdout
    assert summary["last_loss"] < 0.75 * summary["first_loss"], summary


@pytest.mark.parametrize("trainers", [1, pytest.param(2, marks=two_gpus)])
def test_ddp_rpc_hybrid_trains_on_nccl(tmp_path, trainers):
    """NCCL with trainer R on cuda:R when every trainer has a GPU: one trainer on one GPU."""
    _, summary = run("ddp_rpc_hybrid", tmp_path, "--world_size", trainers + 2, "--epochs", 5)
    assert summary["backend"] == "nccl"
    assert summary["dense_weights_identical"] and summary["embedding_table_changed"]
    for name, last in summary["last_loss"].items():
        assert last < 0.7 * summary["first_loss"][name], summary


def test_ddp_rpc_hybrid_remote_module_trains_on_nccl(tmp_path):
    """The tutorial's 2021 revision (RemoteModule) on the same path: one trainer, NCCL on
    cuda:0."""
    _, summary = run("ddp_rpc_hybrid", tmp_path, "--world_size", 3, "--epochs", 5,
                     script="remote_module.py")
    assert summary["backend"] == "nccl"
    assert summary["dense_weights_identical"] and summary["embedding_table_changed"]


@pytest.mark.skipif(GPUS != 1, reason=f"the one-GPU fallback; this machine has {GPUS} GPU(s)")
def test_ddp_rpc_hybrid_says_why_two_trainers_on_one_gpu_use_gloo(tmp_path):
    """Two trainers and one GPU: NCCL needs a GPU a trainer, so Gloo on the CPU, said in each
    trainer's first line."""
    finished, summary = run("ddp_rpc_hybrid", tmp_path, "--world_size", 4, "--epochs", 3)
    assert summary["backend"] == "gloo"
    for trainer in (0, 1):
        assert (f"trainer{trainer}: Gloo on the CPU, as 1 GPU cannot give each of the 2 "
                "trainers its own") in finished.stdout


def test_pipeline_parallel_puts_the_shards_on_the_gpus(tmp_path):
    """Each shard on a GPU of its worker's machine: with one GPU both share it."""
    finished, summary = run("pipeline_parallel", tmp_path, "--num_split", 2, "--batch_size", 16,
                            "--num_batches", 12, "--lr", 0.02)
    assert "ResNetShard1 on worker1, cuda:0" in finished.stdout
    assert f"ResNetShard2 on worker2, cuda:{1 if GPUS > 1 else 0}" in finished.stdout
    split = summary["splits"]["2"]
    assert split["last_loss"] < split["first_loss"], summary


@two_gpus
def test_pipelining_stages_train_on_two_gpus_over_nccl(tmp_path):
    """pipelining.py: NCCL with stage R on cuda:R when every stage has a GPU of its own."""
    finished, summary = run("pipeline_parallel", tmp_path, "--num_split", 2, "--batch_size", 16,
                            "--num_batches", 12, "--lr", 0.02, script="pipelining.py")
    assert "stage 0 of 2 on cuda:0" in finished.stdout
    assert "stage 1 of 2 on cuda:1" in finished.stdout
    for figures in summary["schedules"].values():
        assert figures["2"]["last_loss"] < figures["2"]["first_loss"], summary
        assert all(memory["cuda"] > 0 for memory in summary["peak_memory_mb"].values())


def test_cuda_rpc_shares_one_gpu_through_the_map_0_to_0(tmp_path):
    """cuda_rpc/ with both workers on cuda:0: the map {0: 0} (the default on one GPU, asked for
    with --device_map where there are more). A tensor that worker0 sends from cuda:0 arrives on
    worker1's cuda:0, and the reply on worker0's cuda:0, with no .cpu() on either side."""
    flags = [] if GPUS == 1 else ["--device_map", "0:0"]
    finished, summary = run("cuda_rpc", tmp_path, *flags, "--iterations", 3)
    first = finished.stdout.splitlines()[0]
    assert first.endswith(": worker0 and worker1 share cuda:0, with the device map {0: 0} from "
                          "worker0 to worker1"), finished.stdout
    assert re.search(r"^cpu RPC total execution time: \S+\ncuda RPC total execution time: \S+$",
                     finished.stdout, re.M), finished.stdout
    assert ("worker0 sent a tensor on cuda:0: it arrived on worker1's cuda:0, and worker1's "
            "reply arrived on worker0's cuda:0") in finished.stdout
    assert summary["device_map"] == {"0": 0}
    assert summary["devices"] == {"worker0": "cuda:0", "worker1": "cuda:0"}
    assert summary["landed"] == {"sent": "cuda:0", "landed": "cuda:0", "reply": "cuda:0"}
    assert summary["peak_memory_mb"]["worker0"]["cuda"] > 0, summary


@two_gpus
def test_cuda_rpc_runs_the_recipes_map_0_to_1(tmp_path):
    """cuda_rpc/ as the recipe runs it: worker0 on cuda:0, worker1 on cuda:1, the map {0: 1}. A
    tensor from worker0's cuda:0 arrives on worker1's cuda:1; the reply, through the inverse
    map, on worker0's cuda:0."""
    finished, summary = run("cuda_rpc", tmp_path, "--iterations", 3)
    assert finished.stdout.splitlines()[0] == (
        f"{GPUS} GPUs here, the recipe's map: worker0 on cuda:0, worker1 on cuda:1, with the "
        "device map {0: 1} from worker0 to worker1"), finished.stdout
    assert ("worker0 sent a tensor on cuda:0: it arrived on worker1's cuda:1, and worker1's "
            "reply arrived on worker0's cuda:0") in finished.stdout
    assert summary["device_map"] == {"0": 1}
    assert summary["landed"] == {"sent": "cuda:0", "landed": "cuda:1", "reply": "cuda:0"}
    assert summary["seconds"]["cpu"] > 0 and summary["seconds"]["cuda"] > 0
