/* Mooncake JSONL lines read straight into columns (datasets/importers/mooncake_lines.py): the importer's one
 * reader for speed, in front of the plain reader that judges each line this one refuses (datasets/importers/mooncake.py).
 *
 * A line is blank (JSON whitespace only: space, tab, CR) or one object with exactly the keys timestamp,
 * input_length, output_length and hash_ids, each once, in any order, with JSON whitespace anywhere JSON
 * allows it. The values are plain decimal integers (no sign, no fraction, no exponent, no leading zero):
 * timestamp in ms with timestamp * 1e6 ns <= INT64_MAX, 1 <= input_length <= 2**32,
 * 0 <= output_length <= 2**32 (MAX_TOKENS of datasets/importers/common.py), hash_ids a flat list of values below 2**64 holding exactly
 * ceil(input_length / block size) of them. A UTF-8 byte-order mark may open the file. Anything else -- any
 * other byte, key or value, a second object on the line -- is refused: the parse stops at that line and says
 * where it is, the caller has the plain reader judge it (a valid row, or the reason it is malformed) and goes
 * on after it. Only ASCII is ever accepted, so a line stored here is valid UTF-8 and every value reads the same
 * to Python's json. */
#include <string.h>

#include "kernels.h"

/* What ks_mooncake_parse returns instead of a byte count (mooncake_lines.py has the same codes). */
enum { MC_REFUSED = -1, MC_ROOM = -2 };
/* The slots of the counts array: rows and hashes stored, physical lines and blank lines seen; after MC_REFUSED,
 * where the refused line starts and ends (no newline) and where the next one starts, as offsets into buf. */
enum { MC_ROWS = 0, MC_HASHES = 1, MC_LINES = 2, MC_BLANK = 3, MC_AT = 4, MC_END = 5, MC_NEXT = 6 };
/* The slots of ks_mooncake_bounds' array: bytes '{', the runs of digits, and newlines. */
enum { MC_BRACES = 0, MC_NUMBERS = 1, MC_NEWLINES = 2 };

#define MC_MS_NS 1000000ULL /* ns per timestamp unit (ms) */
#define MC_MAX_TOKENS (1ULL << 32) /* most tokens of input or output (MAX_TOKENS in common.py) */

/* The four keys, one bit each. */
enum { K_TIMESTAMP = 1, K_INPUT = 2, K_OUTPUT = 4, K_HASHES = 8, K_ALL = 15 };

static inline bool has_bom(const uint8_t *p, int64_t len)
{
    return len >= 3 && p[0] == 0xEF && p[1] == 0xBB && p[2] == 0xBF;
}

/* Counts over buf[0:len], added to out: what sizes the columns before the parse (every row is one line and
 * holds a '{', and each of its hashes is a run of digits: a digit after a byte that is none, or at the start of a
 * 4096-byte block -- a run across blocks counts twice, never less than once). Runs, not commas: a line padded
 * with commas sizes no column. A row the plain reader takes from a refused line is bounded alike: its object has
 * a '{', and each of its hashes is an integer literal, a run of digits of its own. */
KS_EXPORT void ks_mooncake_bounds(const uint8_t *buf, int64_t len, int64_t *out)
{
    for (int64_t at = 0; at < len; at += 4096) {  /* 32-bit counts per block: the loop vectorizes */
        int64_t n = len - at < 4096 ? len - at : 4096;
        const uint8_t *b = buf + at;
        uint32_t braces = 0, numbers = (uint8_t)(b[0] - '0') < 10, newlines = 0;
        for (int64_t i = 0; i < n; i++) {
            uint8_t c = b[i];
            braces += c == '{';
            newlines += c == '\n';
        }
        for (int64_t i = 1; i < n; i++)
            numbers += ((uint8_t)(b[i] - '0') < 10) & ((uint8_t)(b[i - 1] - '0') >= 10);
        out[MC_BRACES] += braces;
        out[MC_NUMBERS] += numbers;
        out[MC_NEWLINES] += newlines;
    }
}

static inline const uint8_t *skip_ws(const uint8_t *p, const uint8_t *e)
{
    while (p < e && (*p == ' ' || *p == '\t' || *p == '\r'))
        p++;
    return p;
}

/* A plain JSON non-negative integer at *pp (before e) into *v, *pp moved past it: false on no digit, a leading
 * zero, or a value of 2**64 or more. The byte after it is the caller's to judge. */
static inline bool read_uint(const uint8_t **pp, const uint8_t *e, uint64_t *v)
{
    const uint8_t *s = *pp, *p = s;
    uint64_t x = 0;
    for (uint8_t d; p < e && (d = (uint8_t)(*p - '0')) < 10; p++)
        x = x * 10 + d;  /* wraps beyond 19 digits: redone below */
    int64_t n = p - s;
    if (n == 0 || n > 20 || (n > 1 && *s == '0'))
        return false;
    if (KS_UNLIKELY(n == 20)) {
        x = 0;
        for (int64_t i = 0; i < 19; i++)  /* 19 digits never overflow */
            x = x * 10 + (uint64_t)(s[i] - '0');
        if (__builtin_mul_overflow(x, 10, &x) || __builtin_add_overflow(x, (uint64_t)(s[19] - '0'), &x))
            return false;
    }
    *pp = p;
    *v = x;
    return true;
}

/* The key at p (just past its opening quote) as a K_* bit, p moved past its closing quote; 0 when it is
 * none of the four. */
static inline int read_key(const uint8_t **pp, const uint8_t *e)
{
    static const struct { const char *name; int64_t len; int bit; } keys[] = {
        {"timestamp", 9, K_TIMESTAMP}, {"input_length", 12, K_INPUT},
        {"output_length", 13, K_OUTPUT}, {"hash_ids", 8, K_HASHES}};
    const uint8_t *p = *pp;
    for (int k = 0; k < 4; k++) {
        int64_t n = keys[k].len;
        if (e - p > n && p[n] == '"' && memcmp(p, keys[k].name, (size_t)n) == 0) {
            *pp = p + n + 1;
            return keys[k].bit;
        }
    }
    return 0;
}

/* One non-blank line p..e (no newline) as a row of `block` tokens a hash; MC_REFUSED or MC_ROOM when it cannot be
 * stored. */
static int64_t parse_record(const uint8_t *p, const uint8_t *e, uint64_t block, int64_t *arrival_ns, int64_t *n_in,
                            int64_t *n_out, uint64_t *hashes, int64_t row_cap, int64_t hash_cap, int64_t *counts)
{
    const uint64_t max_i64 = (uint64_t)INT64_MAX;
    int64_t row = counts[MC_ROWS], first = counts[MC_HASHES], h = first;
    uint64_t ts = 0, in = 0, out = 0;
    int seen = 0;
    if (*p++ != '{')
        return MC_REFUSED;
    for (;;) {
        p = skip_ws(p, e);
        if (p >= e || *p++ != '"')
            return MC_REFUSED;
        int key = read_key(&p, e);
        if (key == 0 || (seen & key))
            return MC_REFUSED;
        seen |= key;
        p = skip_ws(p, e);
        if (p >= e || *p++ != ':')
            return MC_REFUSED;
        p = skip_ws(p, e);
        if (key == K_HASHES) {
            if (p >= e || *p++ != '[')
                return MC_REFUSED;
            p = skip_ws(p, e);
            if (p < e && *p == ']') {
                p++;
            } else {
                for (;;) {
                    uint64_t v;
                    if (!read_uint(&p, e, &v))
                        return MC_REFUSED;
                    if (KS_UNLIKELY(h >= hash_cap))
                        return MC_ROOM;
                    hashes[h++] = v;
                    p = skip_ws(p, e);
                    if (p >= e)
                        return MC_REFUSED;
                    uint8_t c = *p++;
                    if (c == ']')
                        break;
                    if (c != ',')
                        return MC_REFUSED;
                    p = skip_ws(p, e);
                }
            }
        } else {
            uint64_t v;
            if (!read_uint(&p, e, &v))
                return MC_REFUSED;
            if (key == K_TIMESTAMP)
                ts = v;
            else if (key == K_INPUT)
                in = v;
            else
                out = v;
        }
        p = skip_ws(p, e);
        if (p >= e)
            return MC_REFUSED;
        uint8_t c = *p++;
        if (c == '}')
            break;
        if (c != ',')
            return MC_REFUSED;
    }
    if (skip_ws(p, e) != e || seen != K_ALL)
        return MC_REFUSED;
    if (ts > max_i64 / MC_MS_NS || in < 1 || in > MC_MAX_TOKENS || out > MC_MAX_TOKENS)
        return MC_REFUSED;
    if ((uint64_t)(h - first) != in / block + (in % block != 0))
        return MC_REFUSED;
    if (KS_UNLIKELY(row >= row_cap))
        return MC_ROOM;
    arrival_ns[row] = (int64_t)(ts * MC_MS_NS);
    n_in[row] = (int64_t)in;
    n_out[row] = (int64_t)out;
    counts[MC_HASHES] = h;
    return 0;
}

/* Parse the whole lines of buf[0:len] (at_end: the last piece too, unterminated) into the columns, rows from
 * counts[MC_ROWS] on and hashes from counts[MC_HASHES] on, with room for row_cap rows and hash_cap hashes;
 * lineno and offsets[row + 1] (hashes before the next row) per row; `block` tokens a hash. The first line of the
 * file (counts[MC_LINES] still 0) may open with a byte-order mark, skipped. Returns the bytes consumed (through
 * the last newline read, or len at the end), MC_REFUSED at a line not in the plain shape (counted in
 * counts[MC_LINES], nothing stored; counts[MC_AT], counts[MC_END] and counts[MC_NEXT] say where it is and where
 * the parse goes on), MC_ROOM when the columns are full. */
KS_EXPORT int64_t ks_mooncake_parse(const uint8_t *buf, int64_t len, int32_t at_end, int64_t block,
                                    int64_t *lineno, int64_t *arrival_ns, int64_t *n_in, int64_t *n_out,
                                    int64_t *offsets, uint64_t *hashes, int64_t row_cap, int64_t hash_cap,
                                    int64_t *counts)
{
    const uint8_t *p = buf, *end = buf + len;
    while (p < end) {
        const uint8_t *nl = memchr(p, '\n', (size_t)(end - p));
        if (nl == NULL && !at_end)
            break;
        const uint8_t *e = nl ? nl : end;
        bool first = counts[MC_LINES] == 0;
        counts[MC_LINES]++;
        const uint8_t *s = skip_ws(first && has_bom(p, e - p) ? p + 3 : p, e);
        if (s == e) {
            counts[MC_BLANK]++;
        } else {
            int64_t row = counts[MC_ROWS];
            int64_t r = parse_record(s, e, (uint64_t)block, arrival_ns, n_in, n_out, hashes, row_cap, hash_cap, counts);
            if (r == MC_REFUSED) {
                counts[MC_AT] = p - buf;
                counts[MC_END] = e - buf;
                counts[MC_NEXT] = nl ? nl + 1 - buf : len;
                return MC_REFUSED;
            }
            if (r < 0)
                return r;
            lineno[row] = counts[MC_LINES];
            offsets[row + 1] = counts[MC_HASHES];
            counts[MC_ROWS] = row + 1;
        }
        p = nl ? nl + 1 : end;
    }
    return (int64_t)(p - buf);
}
