// flashmix._C: the nanobind binding of the flashmix C++ API, one file per
// area (moe.cpp, mhc.cpp, fp8.cpp) over a shared part (common.h / common.cpp).
// python/flashmix/ is the package over it; python/README.md describes both.
#include <nanobind/nanobind.h>

#include "common.h"

NB_MODULE(_C, m) {
  m.doc() = "flashmix._C: the nanobind binding of the flashmix C++ API (use the flashmix package's functions)";
  flashmix::python::register_common(m);
  flashmix::python::register_moe(m);
  flashmix::python::register_mhc(m);
  flashmix::python::register_fp8(m);
#ifdef FLASHMIX_WITH_EP
  flashmix::python::register_ep(m);
#else
  m.def("ep_available", [] { return false; }, "False: this build has no flashmix_ep (built without NCCL).");
#endif
}
