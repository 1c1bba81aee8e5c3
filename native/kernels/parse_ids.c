/* The id lists of kv-cache-tester conversations (datasets/importers/weka.py, parse_id_lists): comma-separated
 * decimal integers read as JSON would read them, in one pass with no Python int per id. */
#include "kernels.h"

/* What ks_weka_parse_ids returns besides the ids (weka.py's _IDS_* codes). */
enum { IDS_OK = 0, IDS_EMPTY = 1, IDS_ZERO = 2, IDS_RANGE = 3, IDS_CHAR = 4 };

/* Parse buf[0:len] (digits and commas) into out (room for one id per comma plus one); *num_read is the
 * number of ids stored. Stops at the first item JSON would not read as this int64: an empty item
 * (IDS_EMPTY), a leading zero (IDS_ZERO), a value of 2^63 or more (IDS_RANGE), a byte that is not a digit
 * or a comma (IDS_CHAR). An empty buffer is one empty item. */
KS_EXPORT int32_t ks_weka_parse_ids(const uint8_t *buf, int64_t len, int64_t *out, int64_t *num_read)
{
    const uint64_t limit = (uint64_t)INT64_MAX;
    uint64_t v = 0;
    int64_t n = 0, digits = 0;
    int32_t status = IDS_OK;
    for (int64_t i = 0; i <= len; i++) {
        uint8_t c = i < len ? buf[i] : ',';
        if (c == ',') {
            if (digits == 0) {
                status = IDS_EMPTY;
                break;
            }
            out[n++] = (int64_t)v;
            v = 0;
            digits = 0;
            continue;
        }
        if (KS_UNLIKELY(c < '0' || c > '9')) {
            status = IDS_CHAR;
            break;
        }
        uint64_t d = (uint64_t)(c - '0');
        if (digits == 1 && v == 0) {
            status = IDS_ZERO;
            break;
        }
        if (v > (limit - d) / 10) {
            status = IDS_RANGE;
            break;
        }
        v = v * 10 + d;
        digits++;
    }
    *num_read = n;
    return status;
}
