/* Mooncake JSONL lines read straight into columns (datasets/importers/mooncake.py): the importer's one reader
 * for speed, in front of the plain reader that judges each line this one refuses.
 *
 * A line is blank (JSON whitespace only: space, tab, CR) or one object with the keys timestamp, input_length,
 * output_length and hash_ids, each once, in any order, with JSON whitespace anywhere JSON allows it, and any
 * other keys whose values are flat: a string, a number, true, false, null, or a list of those (ASCII strings
 * without a backslash or a control byte, numbers of at most 64 bytes; keys alike). The timestamp (ms) is a JSON
 * number with |timestamp * 1e6| ns below 2**63: an integer exactly, any other number as Python reads it (the
 * nearest double, times 1e6, rounded half to even). The other three are plain decimal integers (no sign, no
 * fraction, no exponent, no leading zero): 1 <= input_length <= 2**32, 0 <= output_length <= 2**32 (MAX_TOKENS
 * of datasets/importers/common.py), hash_ids a flat list of values below 2**64 holding exactly
 * ceil(input_length / block size) of them. A UTF-8 byte-order mark may open the file. Anything else -- any
 * other byte, key or value, a second object on the line -- is refused: the parse stops at that line and says
 * where it is, the caller has the plain reader judge it (a valid row, or the reason it is malformed) and goes
 * on after it. Only ASCII is ever accepted, so a line stored here is valid UTF-8 and every value reads the same
 * to Python's json. */
#include <stdlib.h>
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

/* The end of the JSON number at p (before e): -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?, at most 64 bytes;
 * NULL when there is none. *is_int: no fraction and no exponent. */
static const uint8_t *number_end(const uint8_t *p, const uint8_t *e, bool *is_int)
{
    const uint8_t *s = p;
    if (p < e && *p == '-')
        p++;
    const uint8_t *d = p;
    while (p < e && (uint8_t)(*p - '0') < 10)
        p++;
    if (p == d || (p - d > 1 && *d == '0'))
        return NULL;
    *is_int = true;
    if (p < e && *p == '.') {
        const uint8_t *f = ++p;
        while (p < e && (uint8_t)(*p - '0') < 10)
            p++;
        if (p == f)
            return NULL;
        *is_int = false;
    }
    if (p < e && (*p == 'e' || *p == 'E')) {
        p++;
        if (p < e && (*p == '+' || *p == '-'))
            p++;
        const uint8_t *x = p;
        while (p < e && (uint8_t)(*p - '0') < 10)
            p++;
        if (p == x)
            return NULL;
        *is_int = false;
    }
    return p - s <= 64 ? p : NULL;
}

/* The timestamp at *pp (ms) in ns into *ns, *pp moved past it: false unless a JSON number with |ns| < 2**63.
 * An integer is exact; any other number is what Python's json and round(v * 1_000_000) make of it: the nearest
 * double, times 1e6 in double, rounded half to even. */
static bool read_timestamp(const uint8_t **pp, const uint8_t *e, int64_t *ns)
{
    const uint8_t *s = *pp;
    bool is_int;
    const uint8_t *p = number_end(s, e, &is_int);
    if (p == NULL)
        return false;
    if (is_int) {
        bool neg = *s == '-';
        const uint8_t *d = s + neg;
        if (p - d > 19)
            return false;
        uint64_t v = 0;
        for (; d < p; d++)
            v = v * 10 + (uint64_t)(*d - '0');
        if (v > (uint64_t)INT64_MAX / MC_MS_NS)
            return false;
        *ns = neg ? -(int64_t)(v * MC_MS_NS) : (int64_t)(v * MC_MS_NS);
    } else {
        char text[65];
        memcpy(text, s, (size_t)(p - s));
        text[p - s] = 0;
        char *end;
        double x = strtod(text, &end) * 1e6;
        if (end != text + (p - s))  /* a locale that reads numbers otherwise */
            return false;
        double a = x < 0 ? -x : x;
        if (!(a < 9223372036854775808.0))  /* also inf and nan */
            return false;
        if (a < 4503599627370496.0)  /* below 2**52 the sum's rounding (to nearest, ties to even) rounds a */
            a = (a + 4503599627370496.0) - 4503599627370496.0;
        *ns = (int64_t)(x < 0 ? -a : a);
    }
    *pp = p;
    return true;
}

/* Past the rest of a string at p (just past its opening quote) and its closing quote: NULL at a backslash, a
 * control byte, a non-ASCII byte or the line's end. */
static const uint8_t *string_end(const uint8_t *p, const uint8_t *e)
{
    while (p < e && *p != '"') {
        if (*p < 0x20 || *p >= 0x7F || *p == '\\')
            return NULL;
        p++;
    }
    return p < e ? p + 1 : NULL;
}

/* Past the flat value at p (a string, number, true, false, null, or a list of those); NULL when it is none. */
static const uint8_t *flat_value_end(const uint8_t *p, const uint8_t *e, bool in_list)
{
    bool is_int;
    if (p >= e)
        return NULL;
    if (*p == '"')
        return string_end(p + 1, e);
    if (*p == '-' || (uint8_t)(*p - '0') < 10)
        return number_end(p, e, &is_int);
    static const char *words[] = {"true", "false", "null"};
    for (int w = 0; w < 3; w++) {
        size_t n = strlen(words[w]);
        if ((size_t)(e - p) >= n && memcmp(p, words[w], n) == 0)
            return p + n;
    }
    if (*p != '[' || in_list)
        return NULL;
    p = skip_ws(p + 1, e);
    if (p < e && *p == ']')
        return p + 1;
    for (;;) {
        p = flat_value_end(p, e, true);
        if (p == NULL)
            return NULL;
        p = skip_ws(p, e);
        if (p >= e)
            return NULL;
        uint8_t c = *p++;
        if (c == ']')
            return p;
        if (c != ',')
            return NULL;
        p = skip_ws(p, e);
    }
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
    int64_t row = counts[MC_ROWS], first = counts[MC_HASHES], h = first;
    uint64_t in = 0, out = 0;
    int64_t ns = 0;
    int seen = 0;
    if (*p++ != '{')
        return MC_REFUSED;
    for (;;) {
        p = skip_ws(p, e);
        if (p >= e || *p++ != '"')
            return MC_REFUSED;
        int key = read_key(&p, e);
        if (key == 0 && (p = string_end(p, e)) == NULL)
            return MC_REFUSED;
        if (seen & key)
            return MC_REFUSED;
        seen |= key;
        p = skip_ws(p, e);
        if (p >= e || *p++ != ':')
            return MC_REFUSED;
        p = skip_ws(p, e);
        if (key == 0) {
            if ((p = flat_value_end(p, e, false)) == NULL)
                return MC_REFUSED;
        } else if (key == K_TIMESTAMP) {
            if (!read_timestamp(&p, e, &ns))
                return MC_REFUSED;
        } else if (key == K_HASHES) {
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
            if (key == K_INPUT)
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
    if (in < 1 || in > MC_MAX_TOKENS || out > MC_MAX_TOKENS)
        return MC_REFUSED;
    if ((uint64_t)(h - first) != in / block + (in % block != 0))
        return MC_REFUSED;
    if (KS_UNLIKELY(row >= row_cap))
        return MC_ROOM;
    arrival_ns[row] = ns;
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
