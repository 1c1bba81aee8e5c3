/* Writes the agentic stream's JSONL lines (benchmarks/billion_reads_bench.py `build --fast`): the lines its
 * Python writer writes, byte for byte, at C speed. Input (argv[1], little-endian binary, written by the bench):
 *   int64 num_requests R, num_events E, num_convs C, fresh; then per request (R): int64 n_in, n_out, conv,
 *   num_ids, double t; then every request's ids back to back (int64, -1: a fresh id); then per event (E):
 *   int64 copy, request. Output: the lines on stdout; on stderr, the reads and bytes written at each line
 *   whose reads first reach a size in argv[2..] (decimal). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static char *put_u64(char *p, uint64_t v)
{
    char tmp[24];
    int n = 0;
    do {
        tmp[n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    while (n)
        *p++ = tmp[--n];
    return p;
}

static char *put_i64(char *p, int64_t v)
{
    if (v < 0) {
        *p++ = '-';
        return put_u64(p, (uint64_t)(-(v + 1)) + 1);
    }
    return put_u64(p, (uint64_t)v);
}

int main(int argc, char **argv)
{
    FILE *in = fopen(argv[1], "rb");
    int64_t head[4];
    if (!in || fread(head, 8, 4, in) != 4)
        return 2;
    int64_t R = head[0], E = head[1], C = head[2];
    uint64_t fresh = (uint64_t)head[3];
    int64_t *req = malloc((size_t)R * 4 * 8);
    double *t = malloc((size_t)R * 8);
    int64_t *first = malloc((size_t)(R + 1) * 8);
    for (int64_t r = 0; r < R; r++)
        if (fread(req + 4 * r, 8, 4, in) != 4 || fread(t + r, 8, 1, in) != 1)
            return 2;
    first[0] = 0;
    for (int64_t r = 0; r < R; r++)
        first[r + 1] = first[r] + req[4 * r + 3];
    int64_t *ids = malloc((size_t)first[R] * 8 + 8);
    if (fread(ids, 8, (size_t)first[R], in) != (size_t)first[R])
        return 2;
    int nmarks = argc - 2, m = 0;
    int64_t reads = 0, written = 0;
    size_t cap = 1 << 20;
    char *line = malloc(cap);
    static char out[1 << 22];
    setvbuf(stdout, out, _IOFBF, sizeof out);
    for (int64_t e = 0; e < E; e++) {
        int64_t ev[2];
        if (fread(ev, 8, 2, in) != 2)
            return 2;
        int64_t k = ev[0], q = ev[1], n = req[4 * q + 3];
        if ((size_t)(n * 24 + 200) > cap) {
            cap = (size_t)(n * 24 + 200);
            line = realloc(line, cap);
        }
        double when = (double)k * 30.0 + t[q];
        char *p = line;
        memcpy(p, "{\"timestamp\": ", 14), p += 14;
        p = put_i64(p, (int64_t)(when * 1000));
        memcpy(p, ", \"input_length\": ", 18), p += 18;
        p = put_i64(p, req[4 * q]);
        memcpy(p, ", \"output_length\": ", 19), p += 19;
        p = put_i64(p, req[4 * q + 1]);
        memcpy(p, ", \"hash_ids\": [", 15), p += 15;
        int64_t base = (k * C + req[4 * q + 2]) << 24;
        for (int64_t g = 0; g < n; g++) {
            int64_t h = ids[first[q] + g];
            if (g)
                *p++ = ',', *p++ = ' ';
            p = h < 0 ? put_u64(p, ++fresh) : put_i64(p, base + h);
        }
        *p++ = ']', *p++ = '}', *p++ = '\n';
        fwrite(line, 1, (size_t)(p - line), stdout);
        written += p - line;
        reads += n;
        while (m < nmarks && reads >= atoll(argv[2 + m])) {
            fprintf(stderr, "%s %lld %lld\n", argv[2 + m], (long long)reads, (long long)written);
            m++;
        }
    }
    return fflush(stdout) == 0 ? 0 : 1;
}
