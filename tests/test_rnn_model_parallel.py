"""rnn_model_parallel: the distributed RNN (embedding table and decoder on ps, LSTM on the
trainer) learns the synthetic task and a small text, gives the same losses for the same seed
whichever way its ranks are started, and refuses bad input with one line."""

import json
import math
import random
import re
import socket

import programs
import pytest
import torch
import torch.nn as nn
from conftest import (
    ALONE,
    ROOT,
    Run,
    check_timeline,
    copy_example,
    find_free_port,
    load_example,
    outside_imports,
    start_example,
)

rnn = load_example("rnn_model_parallel", "rnn")
rnn_data = load_example("rnn_model_parallel", "data")
rnn_extras = load_example("rnn_model_parallel", "extras")  # what main.py adds: flags, names

# Short but long enough to learn: 4 epochs of the synthetic task are 532 iterations, after
# which the loss is at 0.40-0.45 of its first epoch's (seen with seeds 1 to 3).
SYNTHETIC = ("--seed", 1, "--epochs")
# The small text written below has 18 distinct words; these sizes learn it in 3 epochs.
CORPUS_SIZES = ("--emsize", 16, "--nhid", 16, "--lr", 2, "--bptt", 10, "--batch_size", 5,
                "--epochs", 3)


# --------- Pure logic, in-process --------------------

@pytest.mark.parametrize("gpu_count, expected", [(0, "cpu"), (1, "cuda:0"), (4, "cuda:0")])
def test_embedding_table_goes_to_the_first_gpu_if_any(gpu_count, expected):
    assert rnn.choose_embedding_device(gpu_count) == torch.device(expected)


def test_embedding_table_sends_cpu_tensors_back():
    """Wherever the table is (a GPU if there is one), RPC gets CPU tensors."""
    table = rnn.EmbeddingTable(ntoken=10, ninp=2, dropout=0.5)
    emb = table(torch.randint(10, (5, 3)))
    assert emb.shape == (5, 3, 2) and emb.device == torch.device("cpu")


def test_synthetic_tokens_count_up_and_restart_at_random():
    tokens = rnn_data.synthetic_tokens(5000, 10, seed=3)
    assert torch.equal(tokens, rnn_data.synthetic_tokens(5000, 10, seed=3))
    assert not torch.equal(tokens, rnn_data.synthetic_tokens(5000, 10, seed=4))
    assert 0 <= tokens.min() and tokens.max() < 10
    follows_rule = (tokens[1:] == (tokens[:-1] + 1) % 10).float().mean().item()
    assert abs(follows_rule - 0.91) < 0.02  # 0.9 kept, plus the restarts that land right


def test_lowest_possible_synthetic_loss():
    # The next token is the counted one with probability 0.91, each other with 0.01.
    expected = -(0.91 * math.log(0.91) + 9 * 0.01 * math.log(0.01))
    assert rnn_data.best_synthetic_loss(10, 0.1) == pytest.approx(expected)
    assert rnn_data.best_synthetic_loss(10, 0.1) == pytest.approx(0.5003, abs=1e-4)


def test_tokenize_marks_line_ends():
    assert rnn_data.tokenize("the cat  sat\n\non the mat\n") == [
        "the", "cat", "sat", "<eos>", "<eos>", "on", "the", "mat", "<eos>"]


def test_corpus_vocabulary_in_order_of_first_use(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("a rose is\na rose\n")
    vocabulary, ids = rnn_data.load_corpus(path)
    assert vocabulary == ["a", "rose", "is", "<eos>"]
    assert ids.tolist() == [0, 1, 2, 3, 0, 1, 3]


def test_batchify_makes_one_column_per_sequence():
    source = rnn_data.batchify(torch.arange(23), 4)
    assert source.shape == (5, 4)  # 23 // 4 = 5 steps each, 3 tokens dropped
    assert source[:, 1].tolist() == [5, 6, 7, 8, 9]


def test_targets_are_the_next_tokens_at_every_position():
    source = rnn_data.batchify(torch.arange(24), 2)  # columns 0..11 and 12..23
    windows = list(rnn_data.next_token_windows(source, bptt=5))
    assert [data.shape for data, _ in windows] == [(5, 2), (5, 2), (1, 2)]
    for data, target in windows:
        assert target.shape == data.shape
        assert torch.equal(target, data + 1)
    steps = torch.cat([data for data, _ in windows])
    assert torch.equal(steps, source[:-1])  # every position but the last is an input once
    assert len(list(rnn_data.next_token_windows(source, bptt=5, max_batches=2))) == 2


def test_one_prediction_per_position_enters_the_loss():
    # The three parts of RNNModel, run locally: the decoder's output has a score for every token
    # at every position, and the loss compares each position with its own next token.
    ntoken, seq_len, batch = 10, 5, 3
    table, rnn_layers = rnn.EmbeddingTable(ntoken, 2, 0.0), nn.LSTM(2, 3, 1)
    decoder = rnn.Decoder(ntoken, 3, 0.0)
    tokens = torch.randint(ntoken, (seq_len + 1, batch))
    data, target = next(rnn_data.next_token_windows(tokens, seq_len))
    output, _ = rnn_layers(table(data))
    decoded = decoder(output)
    assert decoded.shape == (seq_len, batch, ntoken)
    loss = nn.CrossEntropyLoss(reduction="none")(decoded.view(-1, ntoken), target.view(-1))
    assert loss.shape == (seq_len * batch,)


def test_worker_names():
    assert [rnn_extras.worker_name(rank, 2) for rank in range(2)] == ["ps", "trainer"]
    assert [rnn_extras.worker_name(rank, 4) for rank in range(4)] == [
        "ps", "trainer1", "trainer2", "trainer3"]


# --------- Command line, in-process --------------------

def parse(argv, env=None):
    """main.py's own parser (the one its `--help` builds), then extras.check_args, as main.py's
    __main__ runs them: the args that the ranks would get."""
    parser = programs.parsed("rnn_model_parallel/main.py").parser
    args = parser.parse_args([str(arg) for arg in argv])
    rnn_extras.check_args(parser, args)
    return args


def bad_input_message(capsys, argv):
    with pytest.raises(SystemExit) as exited:
        parse(["--master_port", find_free_port(), *argv])
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    return err


@pytest.mark.parametrize("argv, expected", [
    (["--world_size", "1"], "must be at least 2"),
    (["--world-size", "two"], "invalid int value"),
    (["--rank", "2"], "outside a world of 2"),
    (["--rank", "-1"], "must be at least 0"),
    (["--epochs", "0"], "must be at least 1"),
    (["--bptt", "0"], "must be at least 1"),
    (["--nlayers", "zero"], "invalid integer (>= 1) value"),
    (["--lr", "0"], "greater than 0"),
    (["--lr", "nan"], "greater than 0"),
    (["--dropout", "1"], "from 0 to less than 1"),
    (["--seed", "-1"], "must be at least 0"),
    (["--master_port", "70000"], "from 1 to 65535"),
    (["--corpus", "/nonexistent/text.txt"], "cannot read it (No such file or directory)"),
    (["--summary_json", "/nonexistent/summary.json"], "no such folder"),
    (["--profile", "/proc/no/such/folder"], "cannot make that folder"),
    (["--epoch", "1"], "unrecognized arguments: --epoch 1"),  # no abbreviated flags
])
def test_bad_input_is_one_line_and_status_2(capsys, argv, expected):
    assert expected in bad_input_message(capsys, argv)


@pytest.mark.parametrize("content, argv, expected", [
    (b"", [], "holds no words"),
    (b" \n\t\n", [], "holds no words"),
    (b"caf\xe9 au lait\n", [], "not a UTF-8 text file"),
    # 6 words counting <eos>: one step for each of 4 sequences, and no next word to predict
    (b"one two three four five\n", ["--batch_size", "4"], "too few for --batch_size 4"),
])
def test_unusable_corpus_is_one_line_and_status_2(tmp_path, capsys, content, argv, expected):
    path = tmp_path / "text.txt"
    path.write_bytes(content)
    assert expected in bad_input_message(capsys, ["--corpus", str(path), *argv])


def test_corpus_folder_is_bad_input(tmp_path, capsys):
    assert "cannot read it" in bad_input_message(capsys, ["--corpus", str(tmp_path)])


def test_a_port_in_use_is_bad_input_where_rank_0_starts(capsys):
    with socket.create_server(("localhost", 0)) as taken:
        port = taken.getsockname()[1]
        for argv in (["--master_port", port], ["--master_port", port, "--rank", 0]):
            with pytest.raises(SystemExit) as exited:
                parse(argv)
            assert exited.value.code == 2
            assert f"cannot listen on localhost:{port}" in capsys.readouterr().err
        # a trainer's command only connects to the port
        assert parse(["--master_port", port, "--rank", 1]).rank == 1


def test_ps_needs_no_corpus():
    args = parse(["--rank", "0", "--master_port", find_free_port(),
                  "--corpus", "/only/on/the/trainers/machine.txt"])
    assert args.rank == 0


def test_torchrun_gives_the_rank_world_and_meeting_point(monkeypatch):
    port = find_free_port()
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    args = parse([])
    assert (args.rank, args.world_size, args.master_addr, args.master_port) == (
        1, 3, "127.0.0.1", str(port))
    assert rnn_extras.worker_name(args.rank, args.world_size) == "trainer1"


def test_torchrun_with_one_process_is_bad_input(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert "torchrun started 1 process(es)" in bad_input_message(capsys, [])


def test_help_shows_every_default_and_the_corpus_sizes():
    out = " ".join(programs.parsed("rnn_model_parallel/main.py").help.split())
    # The help texts and their defaults, not the flags' layout, which argparse changes between
    # Python versions (3.13 writes the metavar once after all of a flag's spellings).
    for default in ("number of processes: ps (rank 0) and the trainers (default: 2)",
                    "(default: 29500)", "(default: localhost)", "passes over the data "
                    "(default: 10)", "size of the embeddings (the tutorial's `ninp`) "
                    "(default: 2)", "LSTM layers (the tutorial's 4 do not learn) (default: 1)"):
        assert default in out
    assert "each trainer an LSTM (and a model of its own)" in out
    assert "--emsize 64 --nhid 64 --bptt 35 --batch_size 20 --epochs 5" in out
    for spelling in ("--world-size", "--max-batches", "--batch-size", "--summary-json"):
        assert spelling in out


def test_a_summary_that_cannot_be_written_at_the_end_says_so_after_the_figures(tmp_path, capsys):
    folder = tmp_path / "gone"
    folder.mkdir()
    args = parse(["--master_port", find_free_port(), "--summary_json", folder / "s.json"])
    folder.rmdir()
    rnn_extras.FIGURES["trainer"] = {"name": "trainer", "losses": [2.3, 1.2], "iterations": 266,
                                     "ntoken": 10, "peak_memory_mb": {"rss": 1},
                                     "train_seconds": 1.0}
    try:
        with pytest.raises(SystemExit) as exited:
            rnn_extras.finish(args, rnn_extras.NotProfiling())
    finally:
        rnn_extras.FIGURES.clear()
    out, err = capsys.readouterr()
    assert exited.value.code == 1
    assert out.startswith("Summary: loss 2.3000 -> 1.2000, perplexity 9.97 -> 3.32 over 1 ")
    assert err == (f"--summary_json {folder / 's.json'}: not written (No such file or "
                   "directory); the Summary line has the run's figures\n")


def test_the_folder_imports_nothing_of_this_project():
    assert outside_imports(ROOT / "rnn_model_parallel") == []


# --------- Whole runs --------------------

def epoch_lines(output, trainer="trainer"):
    """(epoch, loss, perplexity) of every epoch, from the line printed after the tutorial's
    `Training epoch N`, which must come first."""
    figures = re.findall(rf"^Training epoch (\d+)\n{trainer}: epoch (\d+) loss (\S+) "
                         rf"perplexity (\S+)$", output, re.M)
    assert all(tutorial == ours for tutorial, ours, _, _ in figures)
    return [(int(epoch), float(loss), float(ppl)) for _, epoch, loss, ppl in figures]


def write_small_text(path):
    """A text with a grammar to learn: 300 lines of subject, verb, object and a full stop."""
    rng = random.Random(0)
    subjects = ("the cat", "the dog", "a bird", "my friend", "the teacher")
    verbs = ("sees", "likes", "follows", "hears")
    objects = ("the ball", "a tree", "the house", "the river")
    path.write_text("".join(f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)} .\n"
                            for _ in range(300)))
    return path


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """The end-to-end runs of this file, started together and awaited (their iterations spend
    much of their time waiting for each other's messages, so two cores serve them at once):
    - spawn_all: every rank from one command, the synthetic task, profiled, run as the brief
      asks: the folder copied alone, its plain command in a Python where rpc_harness cannot be
      imported;
    - corpus: a small text, each rank its own command, the trainer started first."""
    tmp = tmp_path_factory.mktemp("rnn")
    text = write_small_text(tmp / "small.txt")
    copy = copy_example("rnn_model_parallel", tmp / "copy")
    corpus_port = find_free_port()

    def start(*args, summary=None):
        summary_args = ("--summary_json", tmp / f"{summary}.json") if summary else ()
        return start_example("rnn_model_parallel", *args, *summary_args, log_dir=tmp)

    started = {
        "spawn_all": [Run([*ALONE, "main.py", *SYNTHETIC, 4, "--master_port", find_free_port(),
                           "--summary_json", tmp / "spawn_all.json", "--profile", tmp / "trace"],
                          tmp, cwd=copy)],
        "corpus": [start("--corpus", text, *CORPUS_SIZES, "--master_port", corpus_port,
                         "--rank", 1),
                   start("--corpus", text, *CORPUS_SIZES, "--master_port", corpus_port,
                         "--rank", 0, summary="corpus")],
    }
    try:
        for runs in started.values():
            for run in runs:
                run.wait(timeout=240)
                assert run.returncode == 0, f"{run.cmd}: status {run.returncode}\n{run.output}"
                assert not run.leftovers(), f"processes left running after {run.cmd}"
    finally:
        for runs in started.values():
            for run in runs:
                run.kill_session()
    summaries = {name: json.loads((tmp / f"{name}.json").read_text()) for name in started}
    return started, summaries


def test_spawn_all_runs_the_tutorials_loop(finished):
    (run,), summary = finished[0]["spawn_all"], finished[1]["spawn_all"]
    assert run.returncode == 0, run.output
    device = rnn.choose_embedding_device(torch.cuda.device_count())
    assert f"Embedding table on ps ({device}), LSTM local, decoder on ps" in run.stdout
    assert [epoch for epoch, _, _ in epoch_lines(run.stdout)] == [0, 1, 2, 3]
    assert summary["trainers"] == 1 and summary["ntoken"] == 10
    assert summary["iterations"] == 4 * 133
    assert len(summary["losses"]["trainer"]) == 4
    assert summary["wall_seconds"] > 0 and summary["train_seconds"] > 0
    assert set(summary["peak_memory_mb"]) == {"ps", "trainer"}
    assert run.stdout.strip().splitlines()[-1].startswith("Summary: loss ")  # ps's, the last


def test_spawn_all_learned_the_synthetic_task(finished):
    (run,), summary = finished[0]["spawn_all"], finished[1]["spawn_all"]
    losses = [loss for _, loss, _ in epoch_lines(run.stdout)]
    assert 2.0 < losses[0] < 2.4  # ln 10 = 2.30: guessing
    assert losses[-1] < 0.6 * losses[0], losses
    assert summary["last_loss"] == summary["losses"]["trainer"][-1]
    assert summary["last_loss"] > rnn_data.best_synthetic_loss(10, 0.1)


def test_the_profiled_timeline_shows_the_ps_embedding_lookup(finished):
    """--profile: each rank writes its own trace (rpcrun would merge them; check_timeline does
    here); ps looks up the embeddings (and decodes) for the trainer's steps 3 to 5."""
    (run,) = finished[0]["spawn_all"]
    check_timeline([run], run.log_dir / "trace", ["ps", "trainer"], "ps", {"aten::embedding"})


def test_corpus_mode_learns_a_small_text(finished):
    trainer, ps = finished[0]["corpus"]
    summary = finished[1]["corpus"]
    for run in (ps, trainer):
        assert run.returncode == 0, run.output
    # each rank its own command: ps's (rank 0's) ends with the summary of the trainer's figures
    assert ps.stdout.strip().splitlines()[-1].startswith("Summary: loss ")
    assert "Summary" not in trainer.stdout
    assert re.search(r"^Corpus .*small\.txt: 2100 words, 18 distinct$", trainer.stdout, re.M)
    perplexities = [ppl for _, _, ppl in epoch_lines(trainer.stdout)]
    assert len(perplexities) == 3
    assert perplexities[0] > perplexities[1] > perplexities[2], perplexities
    assert perplexities[-1] < 0.5 * perplexities[0]
    assert summary["ntoken"] == 18 and summary["data"].endswith("small.txt")
    assert summary["last_perplexity"] == pytest.approx(math.exp(summary["last_loss"]))
