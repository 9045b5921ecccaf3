"""Helpers below everything else in the library (torch and the standard library only):
:mod:`~mita.utils.options`, the ``key=value`` options and config strings (nested keys, typed values)."""
