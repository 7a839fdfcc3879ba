/* Two functions a `--uprobe BIN:probe_*` pattern matches: one the kernel probes, and one it
 * refuses (its first instruction is a trap, which a uprobe cannot stand in for). */
#include <unistd.h>

__attribute__((naked, noinline)) void probe_refused(void) { __asm__ volatile("int3\n\tret"); }

__attribute__((noinline)) void probe_called(void) { __asm__ volatile(""); }

int main(void) {
    for (;;) {
        probe_called();
        usleep(1000);
    }
}
