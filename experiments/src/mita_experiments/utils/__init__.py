"""One way to do each chore of the command line and the experiments (torch, the standard library
and :mod:`mita.utils` only):

* :mod:`~mita_experiments.utils.flags`: the ``--out`` / ``--force`` flags every command shares;
* :mod:`~mita_experiments.utils.files`: the output-folder guard and atomic writes;
* :mod:`~mita_experiments.utils.checkpoint`: checkpoints that load without running code, safetensors weights;
* :mod:`~mita_experiments.utils.distributed`: the ``torchrun`` / DDP setup;
* :mod:`~mita_experiments.utils.machine`: the description of the machine a result was measured on.
"""
