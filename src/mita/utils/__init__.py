"""One way to do each chore of the command line and the experiments, below everything else
(it imports only torch and the standard library):

* :mod:`~mita.utils.options`: ``key=value`` options and config strings (nested keys, typed values);
* :mod:`~mita.utils.flags`: the ``--out`` / ``--force`` flags every command shares;
* :mod:`~mita.utils.files`: the output-folder guard and atomic writes;
* :mod:`~mita.utils.checkpoint`: checkpoints that load without running code, safetensors weights;
* :mod:`~mita.utils.distributed`: the ``torchrun`` / DDP setup;
* :mod:`~mita.utils.machine`: the description of the machine a result was measured on.
"""
