"""The kinds of draft, one module each (the protocol: :mod:`specinfer.core.drafter`), and their registration.

To add one: a module here with a class following :class:`~specinfer.core.drafter.Drafter` whose constructor takes
:class:`~specinfer.core.drafter.Models`, and a line in :data:`DRAFTERS`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from specinfer.core.drafter import Drafter, Models
from specinfer.core.drafters.head import VerifierHeadDrafter
from specinfer.core.drafters.ssm import SsmDrafter
from specinfer.core.drafters.suffix import SuffixDrafter

# Every kind by name, in the order a request's trees merge for verification (it numbers the merged tree's nodes)
DRAFTERS: Mapping[str, Callable[[Models], Drafter]] = {
    SsmDrafter.name: SsmDrafter,
    SuffixDrafter.name: SuffixDrafter,
    VerifierHeadDrafter.name: VerifierHeadDrafter,
}
