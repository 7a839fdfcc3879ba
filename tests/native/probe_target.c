/* Functions to probe in groups of 1, 60 and 1,000 (`one_0`, `sixty_00`..`sixty_59`,
 * `many_000`..`many_999`). The program calls all of them until a file named `stop` appears in
 * its working directory, then prints a checksum of a fixed number of rounds and exits 0: its
 * output shows whether probes (or their removal) changed what it computed. */
#include <stdio.h>
#include <unistd.h>

#define FN(name, k)                                                                            \
    __attribute__((noinline)) unsigned long name(unsigned long x) {                           \
        __asm__ volatile("");                                                                  \
        return x * 31 + (k);                                                                   \
    }
#define TEN(g, p)                                                                              \
    FN(g##_##p##0, 0) FN(g##_##p##1, 1) FN(g##_##p##2, 2) FN(g##_##p##3, 3) FN(g##_##p##4, 4)  \
    FN(g##_##p##5, 5) FN(g##_##p##6, 6) FN(g##_##p##7, 7) FN(g##_##p##8, 8) FN(g##_##p##9, 9)
#define HUNDRED(g, p)                                                                          \
    TEN(g, p##0) TEN(g, p##1) TEN(g, p##2) TEN(g, p##3) TEN(g, p##4)                          \
    TEN(g, p##5) TEN(g, p##6) TEN(g, p##7) TEN(g, p##8) TEN(g, p##9)

FN(one_0, 1)
TEN(sixty, 0) TEN(sixty, 1) TEN(sixty, 2) TEN(sixty, 3) TEN(sixty, 4) TEN(sixty, 5)
HUNDRED(many, 0) HUNDRED(many, 1) HUNDRED(many, 2) HUNDRED(many, 3) HUNDRED(many, 4)
HUNDRED(many, 5) HUNDRED(many, 6) HUNDRED(many, 7) HUNDRED(many, 8) HUNDRED(many, 9)

#undef FN
#define FN(name, k) x = name(x);

static unsigned long all_functions(unsigned long x) {
    FN(one_0, 1)
    TEN(sixty, 0) TEN(sixty, 1) TEN(sixty, 2) TEN(sixty, 3) TEN(sixty, 4) TEN(sixty, 5)
    HUNDRED(many, 0) HUNDRED(many, 1) HUNDRED(many, 2) HUNDRED(many, 3) HUNDRED(many, 4)
    HUNDRED(many, 5) HUNDRED(many, 6) HUNDRED(many, 7) HUNDRED(many, 8) HUNDRED(many, 9)
    return x;
}

int main(void) {
    unsigned long x = 0;
    printf("ready\n");
    fflush(stdout);
    while (access("stop", F_OK) != 0) {
        x = all_functions(x);
        usleep(2000);
    }
    x = 0;
    for (int i = 0; i < 1000; i++)
        x = all_functions(x);
    printf("checksum %lu\n", x);
    return 0;
}
