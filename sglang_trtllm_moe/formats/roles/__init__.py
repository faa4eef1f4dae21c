"""The roles a weight format plays, one module each: `serving` (selection, explain), `layout` (in-place
preparation and scalars), `loading` (what an update may write), `kernel` (the runner's call), `checker` (the weight
checker). Each says what a format MAY define there; what every format MUST declare is `formats.base.Spec`, and
`formats.base.WeightFormat` is the spec plus all of them.
"""

from .checker import Checking
from .kernel import Kernel
from .layout import Layout, set_scalar_
from .loading import Loading
from .required import MUST, missing, required_members
from .serving import Serving

__all__ = ["Checking", "Kernel", "Layout", "Loading", "MUST", "Serving", "missing", "required_members", "set_scalar_"]
