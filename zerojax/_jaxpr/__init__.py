"""Everything zerojax reads of JAX's internals, in one package below every other.

* :mod:`~zerojax._jaxpr.form`: the program form (sub-programs, literals, binding equations);
* :mod:`~zerojax._jaxpr.constructs`: the constructs read in zerojax's terms (calls, loops,
  remat regions, ``shard_map``, slices, gathers, collectives);
* :mod:`~zerojax._jaxpr.rules`: how each primitive maps its operands' dimensions;
* :mod:`~zerojax._jaxpr.lines`: the user's source lines of an equation, for messages;
* :mod:`~zerojax._jaxpr.walk` and :mod:`~zerojax._jaxpr.retrace`: the one walk over
  programs every pass shares, and the re-tracing pass;
* :mod:`~zerojax._jaxpr.check`: whether programs are read in this process (checked the
  first time one would be), and what each feature does where they are not;
* :mod:`~zerojax._jaxpr.settings`: the JAX settings read outside programs.

No other module of zerojax names a JAX primitive, a primitive's parameter or a private JAX
module (``tests/test_walk.py`` checks it), and this package imports no other part of
zerojax (``tests/test_layering.py``). Importing it never fails on any JAX release.
"""

from zerojax._jaxpr.check import ProgramReadingOff, ProgramReadingRequired, reading

__all__ = ["ProgramReadingOff", "ProgramReadingRequired", "reading"]
