"""The compile check's reading of ptxas: which kernels spill registers to local memory."""

from __future__ import annotations

from pkv.build import kernel_spills

# As `nvcc -Xptxas -v` (CUDA 13.0, sm_90a) printed it for two decode kernels, one of them spilling.
PTXAS_LOG = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_ZN3pkv23workqueue_decode_kernelI6__halfLi4ELi4EEEvNS_10DecodeArgsEPKiS4_PiS4_' for 'sm_90a'
ptxas info    : Function properties for _ZN3pkv23workqueue_decode_kernelI6__halfLi4ELi4EEEvNS_10DecodeArgsEPKiS4_PiS4_
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 183 registers, used 1 barriers
ptxas info    : Compiling entry function '_ZN3pkv20bucket_decode_kernelI6__halfLi4ELi2EEEvNS_10DecodeArgsEPKiiPib' for 'sm_90a'
ptxas info    : Function properties for _ZN3pkv20bucket_decode_kernelI6__halfLi4ELi2EEEvNS_10DecodeArgsEPKiiPib
    56 bytes stack frame, 72 bytes spill stores, 108 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers, 56 bytes cumulative stack size
ptxas info    : Function properties for _ZN3pkv12some_helperEv
    8 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
"""


def test_only_functions_that_spill_are_reported_with_their_bytes():
    assert kernel_spills(PTXAS_LOG) == [
        ("_ZN3pkv20bucket_decode_kernelI6__halfLi4ELi2EEEvNS_10DecodeArgsEPKiiPib", 72, 108)]


def test_a_log_without_spills_reports_none():
    assert kernel_spills("ptxas info    : 0 bytes gmem\n") == []
    assert kernel_spills(PTXAS_LOG.replace("72 bytes spill stores, 108", "0 bytes spill stores, 0")) == []
