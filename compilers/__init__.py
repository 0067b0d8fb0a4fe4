"""Turn a model into a ladder of verified, optionally signed packages."""

from compilers.manifest import Manifest
from compilers.package import ModelPackage, pack, unpack, write_package
from compilers.variants import VariantEntry, VariantSet

__all__ = ["Manifest", "ModelPackage", "VariantEntry", "VariantSet", "pack", "unpack", "write_package"]
