/* Work split shared by the kernels: thread tid of nth takes items [share(n, tid, nth), share(n, tid + 1, nth)). */
#ifndef INFERFLOW_SPLIT_H
#define INFERFLOW_SPLIT_H
#include <stdint.h>

static inline int64_t share(int64_t n, int tid, int nth) { return n * tid / nth; }

#endif
