"""What the scripts share: the record every result carries (``record``), the common flags (``flags``), memory and
speed measurement (``memory``, ``timing``) and the models the speed benchmarks time (``models``).

The scripts are programs run by path, not modules of a package: each puts ``scripts/`` first on ``sys.path`` in its
first lines and imports ``harness.<module>``.
"""
