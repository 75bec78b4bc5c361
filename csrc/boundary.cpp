#include "boundary.h"

#include <cstdio>
#include <cstdlib>

namespace pipecore::detail {

void assert_gil_held(const char* what) {
#ifdef PIPECORE_CHECK_GIL
  if (!PyGILState_Check()) {
    std::fprintf(stderr, "pipecore._C: raising without the GIL held (a bug in pipecore): %s\n", what);
    std::abort();
  }
#else
  (void)what;
#endif
}

}  // namespace pipecore::detail
