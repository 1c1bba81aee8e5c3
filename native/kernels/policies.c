/* The per-capacity cache policies over the access stream: `lru`, `belady`, `belady-prefix`
 * (oracle/policies/), each a replay at one capacity. The bodies are in policies_body.h, compiled here once
 * for 32-bit ids (streams under 2^30 accesses) and once for 64-bit ids. */
#include <stdlib.h>

#include "kernels.h"

#define KS_BODY "policies_body.h"
#include "by_width.h"
