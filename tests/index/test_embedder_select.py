"""index.embedder.select_providers: CUDA first when present and allowed, CPU always last."""

from __future__ import annotations

import onnxruntime as ort
import pytest

from index.embedder import CPU, CUDA, select_providers

WITH_CUDA = ["TensorrtExecutionProvider", CUDA, CPU]
WITHOUT_CUDA = ["AzureExecutionProvider", CPU]


@pytest.mark.parametrize(
    "prefer, available, expected",
    [
        ("auto", WITH_CUDA, [CUDA, CPU]),
        ("auto", WITHOUT_CUDA, [CPU]),
        ("cpu", WITH_CUDA, [CPU]),
        ("cpu", WITHOUT_CUDA, [CPU]),
        ("gpu", WITH_CUDA, [CUDA, CPU]),
        ("auto", [CUDA, CPU], [CUDA, CPU]),
        ("auto", (CPU,), [CPU]),
    ],
)
def test_select_providers(prefer, available, expected):
    assert select_providers(prefer, available) == expected


def test_cuda_requested_without_cuda_is_an_error():
    with pytest.raises(RuntimeError, match="CUDAExecutionProvider"):
        select_providers("gpu", WITHOUT_CUDA)


@pytest.mark.parametrize("prefer", ["GPU", "CUDA", "", "tensorrt"])
def test_unknown_preference(prefer):
    with pytest.raises(ValueError, match="auto, cpu, gpu"):
        select_providers(prefer, WITH_CUDA)


def test_defaults_to_what_this_onnxruntime_offers():
    providers = select_providers()
    assert providers[-1] == CPU
    assert (CUDA in providers) == (CUDA in ort.get_available_providers())
    # Every selected provider is one this build can actually create a session with.
    assert set(providers) <= set(ort.get_available_providers())


def test_server_sessions_do_not_spin_but_batch_jobs_do(tmp_path):
    from index.embedder import session_options

    assert session_options(2, spinning=False).get_session_config_entry("session.intra_op.allow_spinning") == "0"
    with pytest.raises(Exception, match="allow_spinning"):  # unset: ORT's default, spinning
        session_options(2).get_session_config_entry("session.intra_op.allow_spinning")
    from serving.config import ServerConfig

    assert ServerConfig.flat(index_root=str(tmp_path)).runtime.ort_spinning is False


def test_serve_command_makes_openmp_threads_wait_passively():
    import os
    import subprocess
    import sys

    code = "import serving.__main__, os; print(os.environ['OMP_WAIT_POLICY'])"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "PASSIVE"
    env["OMP_WAIT_POLICY"] = "ACTIVE"  # an operator's choice wins
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ACTIVE"


@pytest.mark.parametrize(
    ("overrides", "runs"),
    [
        ({"batching": True, "workers": 2, "batch_streams": 1}, 1),  # one batch at a time: every thread
        ({"batching": True, "workers": 4}, 2),  # two batch streams by default
        ({"batching": True, "batch_streams": 3, "intra_op_threads": 2}, 1),  # the operator fixed the threads
        ({"batching": False, "workers": 2}, 2),
        ({"batching": False, "workers": 1}, 1),  # never two runs at once
        ({"batching": False, "workers": 2, "intra_op_threads": 2}, 1),
    ],
)
def test_servers_share_the_threads_among_the_runs_they_make_at_once_unless_told_otherwise(tmp_path, overrides, runs):
    from serving.config import ServerConfig

    assert ServerConfig.flat(index_root=str(tmp_path), **overrides).runs_at_once == runs


@pytest.mark.slow
def test_a_session_with_a_share_of_the_threads_for_runs_side_by_side_only_where_it_differs(demo_run):
    import numpy as np

    from core.data.catalog import read_catalog
    from core.data.preprocess import load_batch
    from serving.search.query_embedder import QueryEmbedder

    model = demo_run / "model"
    embedder = QueryEmbedder(model, provider="cpu", intra_op_threads=2, runs_at_once=2)
    assert embedder.side_by_side_session.get_session_options().intra_op_num_threads == 1
    shared = QueryEmbedder(model, provider="cpu", intra_op_threads=8, runs_at_once=3)
    assert shared.side_by_side_session.get_session_options().intra_op_num_threads == 2
    paths = read_catalog(demo_run / "train" / "splits" / "test.csv").paths[:4]
    images = load_batch(list(paths), embedder.contract)
    np.testing.assert_allclose(embedder.embed(images, side_by_side=True), embedder.embed(images), atol=1e-5)
    # Nothing to gain where the sessions would be the same, or no run is made side by side.
    assert QueryEmbedder(model, provider="cpu", intra_op_threads=1, runs_at_once=2).side_by_side_session is None
    plain = QueryEmbedder(model, provider="cpu", intra_op_threads=2)
    assert plain.side_by_side_session is None
    np.testing.assert_array_equal(plain.embed(images, side_by_side=True), plain.embed(images))
