"""The parts of ``tools/hf_sweep.py``: what runs on the ranks, how cells are judged, the report.

Example::

    from hf_sweep_lib.modes import MODES
    print(sorted(MODES))   # ['ckpt', 'dp2xtp2-zero3', 'pp2', 'pp2xtp2', 'tp2', 'tp2-sp', 'tp4']
"""

__all__: list[str] = []
