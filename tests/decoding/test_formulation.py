"""The CPU and CUDA formulations of a decoding pass are chosen in one place
(`streamspec.devices.formulation`); what each device gets is checked here without the device."""

from __future__ import annotations

import torch

from streamspec.devices import formulation
from streamspec.decoding.graphs import cpp_wrapper_wanted, cuda_graphs_wanted
from streamspec.devices import auto_dtype, resolve_dtype


def test_cuda_runs_stream_rows_with_the_main_rows_in_one_graph():
    cuda = formulation("cuda", "inductor", native_ready=True)
    assert not cuda.head_split and not cuda.bf16_stream_rows and not cuda.host_walk
    assert cuda.cuda_graphs and not cuda.cpp_wrapper
    assert formulation(torch.device("cuda:1")).device_type == "cuda"


def test_the_cpu_keeps_its_fewest_rows_formulation():
    cpu = formulation("cpu", "inductor", native_ready=True)
    assert cpu.head_split and cpu.bf16_stream_rows and cpu.host_walk and cpu.cpp_wrapper and not cpu.cuda_graphs
    assert not formulation("cpu", "inductor", native_ready=False).head_split  # torch's kernels: one head call
    assert not formulation("cpu", "aot_eager").cpp_wrapper


def test_switches_turn_the_compiled_formulation_off(monkeypatch):
    monkeypatch.setenv("STREAMSPEC_CUDA_GRAPHS", "0")
    monkeypatch.setenv("STREAMSPEC_CPP_WRAPPER", "off")
    assert not cuda_graphs_wanted("inductor", "cuda") and not cpp_wrapper_wanted("inductor", "cpu")
    monkeypatch.delenv("STREAMSPEC_CUDA_GRAPHS")
    assert cuda_graphs_wanted("inductor", "cuda") and not cuda_graphs_wanted("inductor", None)


def test_dtype_auto_is_bfloat16_on_cuda_and_float32_elsewhere():
    assert auto_dtype("cuda") is torch.bfloat16
    assert auto_dtype("cpu") is torch.float32 and auto_dtype("mps") is torch.float32
    # the path `load_for_inference` takes: the device it resolved, then the dtype for it
    assert resolve_dtype("auto", torch.device("cuda")) is torch.bfloat16
    assert resolve_dtype(None, torch.device("cpu")) is torch.float32
    assert resolve_dtype("float32", torch.device("cuda")) is torch.float32
