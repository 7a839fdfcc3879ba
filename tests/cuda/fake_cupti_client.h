/* The fake CUPTI's API callbacks as the fake driver and runtime receive them: each library has
 * its own copy of this state (static), set by the fake CUPTI at every change through the
 * library's exported setter, which calls take_cupti_callbacks. */
#ifndef FAKE_CUPTI_CLIENT_H
#define FAKE_CUPTI_CLIENT_H

#include "fake_cupti_abi.h"

#include <dlfcn.h>
#include <stdint.h>

/* The fake CUPTI's dispatcher, and which launch entry points have their callback id enabled
 * (FAKE_CUPTI_LAUNCH_*_BIT). A launch whose bit is clear costs one atomic load and a branch. */
static fake_cupti_api_fn cupti_api;
static uint32_t cupti_launch_mask;

static inline void take_cupti_callbacks(fake_cupti_api_fn dispatch, uint32_t mask) {
    if (dispatch) __atomic_store_n(&cupti_api, dispatch, __ATOMIC_RELEASE);
    __atomic_store_n(&cupti_launch_mask, mask, __ATOMIC_RELEASE);
}

#define CUPTI_CALLBACK_ON(bit) \
    __builtin_expect((__atomic_load_n(&cupti_launch_mask, __ATOMIC_ACQUIRE) & (bit)) != 0, 0)

/* A CUPTI loaded before this library's first call (and subscribed then) hands its callbacks
 * over now. */
static void pull_cupti_callbacks(void) {
    void *h = dlopen("libcupti.so.13", RTLD_NOW | RTLD_NOLOAD);
    fake_cupti_push_callbacks_fn push =
        h ? (fake_cupti_push_callbacks_fn)dlsym(h, "fake_cupti_push_callbacks") : NULL;
    if (push) push();
    if (h) dlclose(h);
}

#endif
